# Session 4, H100: the packing grid, continued (issue 3): Qwen3-0.6B 2048 compiled variants, then
# Llama-3.2-1B at 8192 as far as the time box goes (sweeps resume).
. tools/lent_gpu_setup.sh || exit 1
timeout 200 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 2048 --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/
timeout 300 python3 -m harness sweep experiments/packing.toml --models llama-3.2-1b --seq-lens 8192 --variants stock-flex stock-flex-compiled packed-flex-compiled packed-flex packed-flex-nocache packed-varlen --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | tail -12
