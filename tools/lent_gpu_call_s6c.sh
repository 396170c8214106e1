# Session 6, H100, issue 5: gpt-oss-20b at 16384 with compiled layers (the chunked loss is what
# fits it); stock eager experts at 2048 (the other peer baseline, never run on the H100); does
# Qwen3-30B-A3B train on one H100 with bf16 adapters (the report projects ~3,200 tokens)?
. tools/lent_gpu_setup.sh || exit 1
timeout 240 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split-chunked-layers --overwrite --quiet --no-report 2>&1 | tail -1; keep moe
timeout 200 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 1024 2048 --variants grouped_mm-split-bf16lora --overwrite --quiet --no-report 2>&1 | tail -1; keep moe
timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-eager --overwrite --timeout $(( $(left) - 10 )) --quiet --no-report 2>&1 | tail -1; keep moe
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep -- "16384\|bf16lora\|stock-eager"
