# Session 3, last lent-H200 call (issue 5): the compiled-path GPU test with the raised recompile
# limit, Qwen3-30B-A3B with the compiled experts at the other lengths (16384 with the chunked
# loss), then the stock 8192 point that did not finish in session 2.
. tools/lent_gpu_setup.sh || exit 1
r() { cp results/moe/nvidia-h200*.jsonl $OUT/ 2>/dev/null; }
timeout 80 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_moe.py -k "compiled" 2>&1 | grep -E "^E |passed|failed" | head -6
timeout 150 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 2048 4096 --variants grouped_mm-split --overwrite --quiet --no-report 2>&1 | tail -1; r
timeout 100 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 8192 --variants grouped_mm-split --overwrite --quiet --no-report 2>&1 | tail -1; r
timeout 150 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 16384 --variants grouped_mm-split-chunked --quiet --no-report 2>&1 | tail -1; r
timeout 100 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 8192 --variants stock-grouped_mm --quiet --no-report 2>&1 | tail -1; r
python3 tools/show_rows.py results/moe/nvidia-h200*.jsonl
