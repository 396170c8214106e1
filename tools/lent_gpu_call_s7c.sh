# Session 7, H100, issue 5: gpt-oss-20b graphed at 2048 with bf16 adapters beside stock graphed
# (one run), then the graphed pair at 1024 tokens.
. tools/lent_gpu_setup.sh || exit 1
PACKBENCH_STACKS_EVERY=120 timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm-graph grouped_mm-split-layers-bf16lora-graph grouped_mm-split-layers-graph --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
keep moe
PACKBENCH_STACKS_EVERY=120 timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 1024 --variants stock-grouped_mm-graph grouped_mm-split-layers-graph --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1
keep moe
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep graph
