# Not yet run (session 4 ran out of device time). Issue 5: compiled layers on top of our MoE path,
# side by side at 2048. Issue 3: the rest of the packing grid (Qwen3-0.6B and Llama-3.2-1B rows
# at 2048/8192 are in results/packing; Qwen3-14B and 16384 are missing). ~45 s per small point,
# ~20 s more for the first point of a sweep; sweeps resume, so repeat the call until done.
. tools/lent_gpu_setup.sh || exit 1
timeout 200 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants grouped_mm-split grouped_mm-split-layers --overwrite --quiet --no-report 2>&1 | tail -1
mkdir -p $OUT/moe && cp results/moe/nvidia-h100*.jsonl $OUT/moe/
# The preloaded launcher (not yet tried on a GPU): one scratch point first, the grid with it if ok.
L=process
timeout 90 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 2048 --variants packed-varlen --launcher preloaded --results /tmp/scratch --quiet --no-report 2>&1 | tail -1 | grep -q "'ok': 1" && L=preloaded
echo "launcher for the grid: $L"
timeout 360 python3 -m harness sweep experiments/packing.toml --models llama-3.2-1b qwen3-0.6b --seq-lens 2048 8192 16384 --launcher $L --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl results/packing/nvidia-h100*.jsonl | tail -20
