# Session 3, fourth lent-H100 call (issue 5): the GPU numerics test with its fp32-truth bar,
# then gpt-oss-20b at 8192 (compiled) and 16384 (compiled, chunked loss) with room to finish;
# the point logs come back in logs.tgz.
. tools/lent_gpu_setup.sh || exit 1
r() { cp results/moe/nvidia-h100*.jsonl $OUT/ 2>/dev/null; tar czf $OUT/logs.tgz results/moe/logs 2>/dev/null; }
timeout 100 python3 -m pytest -q -x -p no:cacheprovider --tb=short tests/test_gpu_moe.py -k "test_model_matches_loop_bf16" 2>&1 | grep -E "^E |passed|failed" | head -8
timeout 200 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 8192 --variants grouped_mm-split --overwrite --quiet --no-report 2>&1 | tail -1; r
timeout 270 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split-chunked --quiet --no-report 2>&1 | tail -1; r
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep "grouped_mm-split\|16384"
