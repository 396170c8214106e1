# Session 4, H100: packed flex traced into the compiled layers vs stock flex compiled, Qwen3-0.6B
# at 8192 (issue 3), side by side; then the regional GPU tests.
. tools/lent_gpu_setup.sh || exit 1
V="stock-flex stock-flex-compiled packed-flex packed-flex-compiled packed-varlen packed-varlen-compiled"
timeout 330 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --variants $V --overwrite --quiet --no-report 2>&1 | tail -3
cp results/packing/nvidia-h100*.jsonl $OUT/
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_regional.py 2>&1 | grep -E "^E |passed|failed" | head -20
tar czf $OUT/logs.tgz results/packing/logs 2>/dev/null
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl
