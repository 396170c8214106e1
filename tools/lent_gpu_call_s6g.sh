# Session 6, H100, issue 5 (the last of the device time): gpt-oss-20b at 2048, stock beside ours
# with compiled layers and bf16 adapters; does dropping peft's fp32 upcast close the gap to 3x?
. tools/lent_gpu_setup.sh || exit 1
timeout 170 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm grouped_mm-split-layers-bf16lora --overwrite --quiet --no-report 2>&1 | tail -1; keep moe
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep " 2048 "
