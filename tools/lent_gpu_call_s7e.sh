# Session 7, H200, issue 5: Qwen3-30B-A3B graphed (optim.graphs), ours beside stock, at the two
# lengths where ours eager missed the seeds' H100 figures (host-bound there: p80/p20 1.1-1.25).
# Arguments as tools/lent_gpu_call_s6h.sh: T:variant[,variant...] groups, each one sweep.
. tools/lent_gpu_setup.sh || exit 1
for g in "$@"; do
  [ $(left) -gt 100 ] || { echo "no time left for $g"; break; }
  T=${g%%:*}; V=${g#*:}
  PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens $T --variants ${V//,/ } --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
  keep moe
done
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl | grep graph
