# Session 7, H200: optim.graphs' whole GPU test file on the fixed capture, then the stock eager
# experts on Qwen3-30B-A3B (issue 5's other peer baseline) at 1024 tokens while time is left.
. tools/lent_gpu_setup.sh || exit 1
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -p no:cacheprovider 2>&1 | tail -30 > $OUT/pytest-graphs.txt
tail -3 $OUT/pytest-graphs.txt
PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 1024 --variants stock-eager --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
keep moe
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl | grep " 1024 "
