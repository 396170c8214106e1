# Session 2, last lent-H100 call (issue 5): gpt-oss-20b routing-only pair (sorted vs loop with
# peft's merged LoRA) at 2048, then 16384 tokens, ours first, then stock.
. tools/lent_gpu_setup.sh || exit 1
timeout 200 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants sorted-merged loop-merged --quiet --no-report 2>&1 | tail -2
timeout 110 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split --quiet --no-report 2>&1 | tail -2
timeout 190 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants stock-grouped_mm --quiet --no-report 2>&1 | tail -2
cp results/moe/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl
