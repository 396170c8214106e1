# Second lent-H100 call for packing/offload: GPU tests after the fixes, the offload bench at the
# REFERENCE.md offload workload (Qwen3-8B, 4 x 4096 tokens), the rest of the packing slice.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_packing.py tests/test_gpu_offload.py 2>&1 | tee $OUT/gpu_tests.log | tail -30
timeout 200 python3 -m harness.bench_offload --out $OUT/bench_offload.json --model qwen3-8b --seq-len 4096 --batch-size 4 --steps 5 --attn flex_attention 2>&1 | tee $OUT/bench_offload.log | tail -12
timeout 210 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --variants stock-flex packed-varlen packed-varlen-nocache packed-flex --quiet --no-report 2>&1 | tail -3
cp results/packing/*.jsonl $OUT/ 2>/dev/null
