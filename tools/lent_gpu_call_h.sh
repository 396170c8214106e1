# Session 2, lent-H100 call (issue 5): gpt-oss-20b, ours (grouped_mm + split LoRA) vs stock
# (flex_attention + experts grouped_mm + peft) across packed lengths, then the routing-only pair
# (sorted vs loop, peft's merged LoRA) at 2048. The sweep resumes: 2048 ours/stock exist already.
. tools/lent_gpu_setup.sh || exit 1
timeout 420 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 1024 4096 8192 16384 --variants stock-grouped_mm grouped_mm-split --quiet --no-report 2>&1 | tail -3
timeout 130 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants sorted-merged loop-merged --quiet --no-report 2>&1 | tail -3
cp results/moe/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl
