# Session 5, H100, issue 3: the packing grid's core variants (every backend cache on/off, stock
# sdpa/flex) for Llama-3.2-1B and Qwen3-0.6B at 2048/8192/16384 (finished points are skipped).
# Issue 2: the preloaded launcher on one scratch point first; the grid uses it if that point is ok.
. tools/lent_gpu_setup.sh || exit 1
CORE="stock-sdpa stock-flex packed-sdpa packed-sdpa-nocache packed-flex packed-flex-nocache packed-varlen packed-varlen-nocache"
L=process
timeout 100 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 2048 --variants packed-varlen --launcher preloaded --results /tmp/scratch --quiet --no-report > $OUT/preloaded.txt 2>&1
tail -2 $OUT/preloaded.txt; grep -q "'ok': 1" $OUT/preloaded.txt && L=preloaded
echo "launcher for the grid: $L"
timeout 440 python3 -m harness sweep experiments/packing.toml --models llama-3.2-1b qwen3-0.6b --seq-lens 2048 8192 16384 --variants $CORE --launcher $L --quiet --no-report 2>&1 | tail -2
cp results/packing/nvidia-h100*.jsonl $OUT/
tar czf $OUT/logs.tgz results/packing/logs /tmp/scratch 2>/dev/null
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | tail -30
