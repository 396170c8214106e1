# Session 7, H200: the capture fix (warm-up on transformers' capture path, optim.graphs), its
# one-document GPU test, then Qwen3-30B-A3B graphed at 1024 tokens (one document per row), the
# length whose capture failed in call s7e. Arguments as tools/lent_gpu_call_s7e.sh.
. tools/lent_gpu_setup.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -k "one-doc or refused" -p no:cacheprovider 2>&1 | tail -30 > $OUT/pytest-graphs.txt
tail -3 $OUT/pytest-graphs.txt
for g in "$@"; do
  [ $(left) -gt 100 ] || { echo "no time left for $g"; break; }
  T=${g%%:*}; V=${g#*:}
  PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens $T --variants ${V//,/ } --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
  keep moe
done
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl | grep graph
