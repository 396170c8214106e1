# Session 7, H200, issue 5: the stock eager experts on Qwen3-30B-A3B at the longer lengths, in
# order, while the call has time (a point that runs out of it is a timeout row). SEQ="T ..."
# picks the lengths (the second and third runs: SEQ=8192, SEQ=16384).
. tools/lent_gpu_setup.sh || exit 1
for T in ${SEQ:-2048 4096 8192}; do
  [ $(left) -gt 120 ] || { echo "no time left for $T"; break; }
  PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens $T --variants stock-eager --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
  keep moe
done
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl | grep stock-eager
