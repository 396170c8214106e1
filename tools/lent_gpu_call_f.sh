# Session 2, third lent-H100 call (issue 4): the remaining H100 offload points, one process each,
# 2 measured steps per mode (GPU-bound: p80/p20 ~1.001), the JSON written as each finishes.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
B="python3 -m harness.bench_offload --warmup 1 --steps 2 --attn flex_attention"
timeout 190 $B --target-mib 256 --out $OUT/offload_8b_8192.json --model qwen3-8b --seq-len 8192 2>&1 | grep -v "round 0" | tail -6
timeout 190 $B --target-mib 160 --out $OUT/offload_14b_8192.json --model qwen3-14b --seq-len 8192 --no-trace 2>&1 | grep -v "round 0" | tail -6
timeout 190 $B --target-mib 200 --out $OUT/offload_14b_2048.json --model qwen3-14b --seq-len 2048 2>&1 | grep -v "round 0" | tail -6
