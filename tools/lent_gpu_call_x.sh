# Session 5, H100, issue 3: the 16384 points of Llama-3.2-1B and Qwen3-0.6B (Llama stock flex at
# 16384 ran past 4 min in call w with an empty log: now --timeout 150 stops it with its stacks in
# the log), then Qwen3-14B at 2048 as far as the box goes. Sweeps resume; rows copied after each.
. tools/lent_gpu_setup.sh || exit 1
END=$((SECONDS + 560))
CORE="stock-sdpa stock-flex packed-sdpa packed-sdpa-nocache packed-flex packed-flex-nocache packed-varlen packed-varlen-nocache"
sweep() { local left=$((END - SECONDS)); [ $left -gt 30 ] || return 0
  timeout $left python3 -m harness sweep experiments/packing.toml --variants $CORE --launcher preloaded --quiet --no-report "$@" 2>&1 | tail -1
  cp results/packing/nvidia-h100*.jsonl $OUT/; tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null; }
sweep --models llama-3.2-1b qwen3-0.6b --seq-lens 16384 --timeout 150
sweep --models qwen3-14b --seq-lens 2048 --timeout 150
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | tail -16
