# Session 4, H100: the packing grid, continued (issue 3): Qwen3-0.6B at 8192 (the variants still
# missing) then at 2048. Sweeps resume; each step copies its rows out before the next.
. tools/lent_gpu_setup.sh || exit 1
timeout 215 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/
timeout 320 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 2048 --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/
tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl
