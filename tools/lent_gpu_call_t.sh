# Session 4, H100: packed flex traced into the compiled layers (after the layer_idx fix) and
# packed varlen compiled, side by side with stock flex eager and compiled (issue 3); then the
# offload sweep's two remaining modes for Qwen3-8B at 8192 (issue 4; none/single ran in call s).
. tools/lent_gpu_setup.sh || exit 1
V="stock-flex stock-flex-compiled packed-flex-compiled packed-varlen-compiled"
timeout 270 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --variants $V --overwrite --quiet --no-report 2>&1 | tail -2
cp results/packing/nvidia-h100*.jsonl $OUT/
timeout 295 python3 -m harness sweep experiments/offload.toml --models qwen3-8b --seq-lens 8192 --quiet --no-report 2>&1 | tail -2
mkdir -p $OUT/offload && cp results/offload/nvidia-h100*.jsonl $OUT/offload/
tar czf $OUT/logs.tgz results/packing/logs results/offload/logs 2>/dev/null
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl results/offload/nvidia-h100*.jsonl
