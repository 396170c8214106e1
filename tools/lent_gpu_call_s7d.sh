# Session 7, H100, issue 5: gpt-oss-20b graphed at 2048, bf16 adapters for stock as well as for
# ours, beside stock with peft's fp32 adapters, in one run.
. tools/lent_gpu_setup.sh || exit 1
PACKBENCH_STACKS_EVERY=120 timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm-bf16lora-graph stock-grouped_mm-graph grouped_mm-split-layers-bf16lora-graph --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
keep moe
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep graph
