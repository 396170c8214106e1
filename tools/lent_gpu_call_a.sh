# One lent-H100 call: GPU tests of packing/offload, then the offload and packing benches, then a
# packing sweep slice. Each step has its own time limit so a slow one cannot starve the rest.
. tools/lent_gpu_setup.sh || exit 1
set -o pipefail
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_packing.py tests/test_gpu_offload.py 2>&1 | tee $OUT/gpu_tests.log | tail -30
timeout 170 python3 -m harness.bench_offload --out $OUT/bench_offload.json --model qwen3-8b --seq-len 2048 --batch-size auto --target-mib 256 --steps 5 2>&1 | tee $OUT/bench_offload.log | tail -15
timeout 80 python3 -m harness.bench_packing --out $OUT/bench_packing.json --models qwen3-0.6b llama-3.2-1b --lengths 2048 8192 --repeats 10 2>&1 | tee $OUT/bench_packing.log | tail -25
timeout 120 python3 -m harness sweep experiments/packing.toml --models qwen3-0.6b --seq-lens 8192 --variants stock-flex packed-varlen packed-varlen-nocache packed-flex --quiet --no-report 2>&1 | tail -3
cp results/packing/*.jsonl $OUT/ 2>/dev/null
