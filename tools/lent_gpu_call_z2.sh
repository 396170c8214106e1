# Session 5, H100, issue 3: the rest of Qwen3-0.6B at 16384, then Qwen3-14B at 2048, 8192 and
# 16384 (stock flex at 16384 last: on both small models its first step ran past 150 s in call x).
. tools/lent_gpu_setup.sh || exit 1
END=$((SECONDS + 560))
CORE="stock-sdpa packed-sdpa packed-sdpa-nocache packed-flex packed-flex-nocache packed-varlen packed-varlen-nocache stock-flex"
sweep() { local left=$((END - SECONDS)); [ $left -gt 30 ] || return 0
  timeout $left python3 -m harness sweep experiments/packing.toml --launcher preloaded --quiet --no-report "$@" 2>&1 | tail -1
  cp results/packing/nvidia-h100*.jsonl $OUT/; tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null; }
sweep --models qwen3-14b --seq-lens 16384 --variants ${CORE% stock-flex} --timeout 300
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | tail -22
