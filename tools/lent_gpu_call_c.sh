# Third lent-H100 call: packing GPU test after the MoE-precision change, the offload bench's
# c/g/VRAM summary (no profiler trace), and a gpt-oss-20b MoE slice at 2048 tokens.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_packing.py 2>&1 | tee $OUT/gpu_tests.log | tail -8
timeout 220 python3 -m harness.bench_offload --out $OUT/bench_offload.json --model qwen3-8b --seq-len 4096 --batch-size 4 --steps 5 --attn flex_attention --no-trace 2>&1 | tee $OUT/bench_offload.log | tail -12
timeout 200 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm grouped_mm-split sorted-merged --quiet --no-report 2>&1 | tail -3
cp results/moe/*.jsonl $OUT/ 2>/dev/null
