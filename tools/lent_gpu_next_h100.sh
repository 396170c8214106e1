# Not yet run: the packing grid's small models (issue 3), then the offload experiment as a sweep
# (issue 4; bench_offload produced the committed numbers). Sweeps resume; rows are written as
# each point finishes.
. tools/lent_gpu_setup.sh || exit 1
timeout 330 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b llama-3.2-1b --seq-lens 2048 8192 --quiet --no-report 2>&1 | tail -2
timeout 250 python3 -m harness sweep experiments/offload.toml --models qwen3-8b --seq-lens 8192 --quiet --no-report 2>&1 | tail -2
cp results/packing/nvidia-h100*.jsonl results/offload/nvidia-h100*.jsonl $OUT/
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl results/offload/nvidia-h100*.jsonl
