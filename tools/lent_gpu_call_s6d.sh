# Session 6, H100, issue 3: stock flex at 16384 on Qwen3-0.6B and Qwen3-14B (call s6a showed that
# on Llama-3.2-1B it is slow to start, not hung), with stacks every 45 s.
. tools/lent_gpu_setup.sh || exit 1
for M in qwen3-0.6b qwen3-14b; do
  PACKBENCH_STACKS_EVERY=45 timeout $(left) python3 -m harness sweep experiments/packing.toml --models $M --seq-lens 16384 --variants stock-flex --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
  keep packing
done
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | grep "16384 stock-flex"
