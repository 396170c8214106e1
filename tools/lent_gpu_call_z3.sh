# Session 5, H100, issue 5: our gpt-oss-20b path with and without compiled decoder layers, side
# by side at 2048 tokens (grouped_mm-split-layers never ran before); then, if time is left, stock
# flex for Qwen3-14B at 16384 (issue 3) with a 120 s limit.
. tools/lent_gpu_setup.sh || exit 1
timeout 230 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants grouped_mm-split grouped_mm-split-layers --overwrite --launcher preloaded --quiet --no-report 2>&1 | tail -1
mkdir -p $OUT/moe; cp results/moe/nvidia-h100*.jsonl $OUT/moe/; tar czf $OUT/moelogs.tgz results/moe/logs 2>/dev/null
timeout 135 python3 -m harness sweep experiments/packing.toml --models qwen3-14b --seq-lens 16384 --variants stock-flex --timeout 120 --launcher preloaded --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/; tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | tail -3
