# Session 8, H100, issue 5: gpt-oss-20b side by side per length, in one run each: the stock
# eager experts, stock grouped_mm + peft and ours, the last two graphed with bf16 adapters (the
# 2048 pair's setting). Arguments: T:variant[,variant...] groups (tools/lent_gpu_setup.sh).
. tools/lent_gpu_setup.sh || exit 1
sweep_groups experiments/moe.toml gpt-oss-20b "$@"
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | tail -12
