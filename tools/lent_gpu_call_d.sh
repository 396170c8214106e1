# Session 2, first lent-GPU call: the offload GPU tests after the closure fix, the host-jitter
# diagnosis for issue 2's spread, then Qwen3-8B offload side by side at ~200 MiB per layer input.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_offload.py 2>&1 | tee $OUT/gpu_tests.log | tail -4
timeout 200 python3 tools/diag_host.py --out $OUT/diag_host.json 2>&1 | tail -14
timeout 420 python3 -m harness.bench_offload --out $OUT/offload_8b.json --model qwen3-8b --seq-len 8192 --seq-len 2048 --target-mib 200 --warmup 1 --steps 4 --attn flex_attention 2>&1 | tee $OUT/offload_8b.log | grep -v "round 0"
