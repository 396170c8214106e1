# Session 7, H100: the rest of smoke-gpu's graphed points, then gpt-oss-20b at 2048 tokens (issue
# 5's 3x target): stock and ours, each eager and as a replayed CUDA graph, side by side in one run.
. tools/lent_gpu_setup.sh || exit 1
timeout 150 python3 -m harness sweep experiments/smoke-gpu.toml --variants sdpa-graph flex-graph --launcher preloaded --quiet --no-report 2>&1 | tail -1
keep smoke-gpu
PACKBENCH_STACKS_EVERY=120 timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm-graph grouped_mm-split-layers-graph stock-grouped_mm grouped_mm-split-layers --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
keep moe
python3 tools/show_rows.py results/smoke-gpu/*.jsonl | grep graph | tail -5
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep " 2048 "
