# Session 6, H200, issue 5: the Qwen3-30B-A3B points still missing (REFERENCE: stock peft cannot
# train it on an 80 GB card). Arguments: T:variant[,variant...] groups, each one sweep side by
# side, in the order given, while the call has time:
#   bash tools/lent_gpu_call_s6h.sh 1024:grouped_mm-split-layers 2048:grouped_mm-split-layers
# A point takes ~2-4 min (48 layers, 128 experts); the stacks every 90 s say where a slow one is.
. tools/lent_gpu_setup.sh || exit 1
for g in "$@"; do
  [ $(left) -gt 100 ] || { echo "no time left for $g"; break; }
  T=${g%%:*}; V=${g#*:}
  PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens $T --variants ${V//,/ } --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
  keep moe
done
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl
