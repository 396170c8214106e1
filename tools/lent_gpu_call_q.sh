# Session 4, H100: optim.regional side by side with eager on Qwen3-0.6B at 8192 packed tokens
# (issue 3's 1.3x target), every packed backend and the stock flex peer, then the GPU tests.
. tools/lent_gpu_setup.sh || exit 1
V="stock-flex stock-flex-compiled packed-sdpa packed-sdpa-compiled packed-flex packed-flex-compiled packed-varlen packed-varlen-compiled"
timeout 400 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --variants $V --overwrite --quiet --no-report 2>&1 | tail -3
cp results/packing/nvidia-h100*.jsonl $OUT/
tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null
timeout 160 python3 -m pytest -q -m gpu tests/test_gpu_regional.py 2>&1 | tail -6
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl
