# Session 2, second lent-H100 call (issue 4): offload side by side with the loss chunked, so
# the layer inputs, not the logits, set the peak. ~256 MiB per layer input (the seeds' scale).
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
B="python3 -m harness.bench_offload --target-mib 256 --warmup 1 --steps 3 --attn flex_attention"
timeout 200 $B --out $OUT/offload_8b_8192.json --model qwen3-8b --seq-len 8192 2>&1 | grep -v "round 0" | tail -7
timeout 170 $B --out $OUT/offload_8b_2048.json --model qwen3-8b --seq-len 2048 --no-trace 2>&1 | grep -v "round 0" | tail -6
timeout 200 $B --out $OUT/offload_14b_8192.json --model qwen3-14b --seq-len 8192 2>&1 | grep -v "round 0" | tail -7
