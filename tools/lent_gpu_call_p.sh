# Session 3, last lent-H100 call (issue 5): is the 16384 OOM the experts' or the loss's? Stock
# experts with the chunked loss, and ours with the model's own full loss, at 16384 on the H100.
. tools/lent_gpu_setup.sh || exit 1
r() { cp results/moe/nvidia-h100*.jsonl $OUT/ 2>/dev/null; }
timeout 210 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants stock-grouped_mm-chunked --quiet --no-report 2>&1 | tail -1; r
timeout 210 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split --quiet --no-report 2>&1 | tail -1; r
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep 16384
