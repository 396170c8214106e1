# Session 8, H200, issue 5: Qwen3-30B-A3B's peer baselines side by side in one run (stock eager
# and stock grouped_mm experts, with peft) beside ours. Arguments: T:variant[,variant...] groups.
. tools/lent_gpu_setup.sh || exit 1
sweep_groups experiments/moe.toml qwen3-30b-a3b "$@"
python3 tools/show_rows.py results/moe/nvidia-h200.jsonl | tail -8
