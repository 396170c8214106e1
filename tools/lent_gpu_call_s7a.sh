# Session 7, H100: optim.graphs (the whole step as CUDA graphs). Its GPU tests first: does the
# step capture at all (stock Llama/Qwen3, optim.moe grouped_mm + split LoRA) and train as the
# eager steps do; then smoke-gpu's graphed variants, for issue 2's spread.
. tools/lent_gpu_setup.sh || exit 1
timeout 280 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -p no:cacheprovider -x 2>&1 | tail -40 > $OUT/pytest-graphs.txt
tail -4 $OUT/pytest-graphs.txt
timeout $(left) python3 -m harness sweep experiments/smoke-gpu.toml --variants sdpa-graph flex-graph --launcher preloaded --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -2
keep smoke-gpu
python3 tools/show_rows.py results/smoke-gpu/*.jsonl | grep graph
