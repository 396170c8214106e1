# Session 3, third lent-H100 call (issue 5): why the GPU numerics test failed last call, then
# gpt-oss-20b with the compiled experts at every length; 16384 with the chunked loss, ours and
# stock (the full-loss points at 16384 run out of memory or thrash on 80 GB).
. tools/lent_gpu_setup.sh || exit 1
r() { cp results/moe/nvidia-h100*.jsonl $OUT/ 2>/dev/null; }
timeout 100 python3 -m pytest -q -x -p no:cacheprovider --tb=short tests/test_gpu_moe.py -k "test_model_matches_loop_bf16" 2>&1 | grep -E "^E |assert|passed|failed" | head -12
timeout 250 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 1024 4096 8192 --variants grouped_mm-split --overwrite --quiet --no-report 2>&1 | tail -1; r
timeout 140 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split-chunked --quiet --no-report 2>&1 | tail -1; r
timeout 110 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants stock-grouped_mm-chunked --quiet --no-report 2>&1 | tail -1; r
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep "grouped_mm-split\|16384"
