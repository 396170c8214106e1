# Not yet run: gpt-oss-20b at 16384 tokens (issue 5; ours then stock, which REFERENCE.md saw run
# out of memory) with room for the ~25 s build and 13 steps of ~2-4 s, then the packing grid's
# small models (issue 3). Sweeps resume; rows are written as each point finishes.
. tools/lent_gpu_setup.sh || exit 1
timeout 240 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split stock-grouped_mm --quiet --no-report 2>&1 | tail -2
timeout 330 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b llama-3.2-1b --seq-lens 2048 8192 --quiet --no-report 2>&1 | tail -2
cp results/moe/nvidia-h100*.jsonl results/packing/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl results/packing/nvidia-h100*.jsonl
