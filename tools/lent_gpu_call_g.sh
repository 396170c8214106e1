# Session 2, lent-H200 call: Qwen3-32B offload side by side (issue 4: 64 GB of bf16 weights), then
# Qwen3-30B-A3B, which stock peft cannot train on an 80 GB card (issue 5), ours vs stock grouped_mm.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
timeout 300 python3 -m harness.bench_offload --warmup 1 --steps 2 --attn flex_attention --target-mib 160 --out $OUT/offload_32b_8192.json --model qwen3-32b --seq-len 8192 2>&1 | grep -v "round 0" | tail -6
timeout 270 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 2048 8192 --variants grouped_mm-split stock-grouped_mm --quiet --no-report 2>&1 | tail -4
cp results/moe/*.jsonl $OUT/ 2>/dev/null
python3 tools/show_rows.py results/moe/nvidia-h200*.jsonl
