# Session 3, first lent-H200 call: the GPU MoE tests (compiled path with dense routing), the last
# offload point (issue 4: Qwen3-32B at 2048), then Qwen3-30B-A3B with the compiled experts at 1024.
. tools/lent_gpu_setup.sh || exit 1
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_moe.py 2>&1 | grep -E "^E |passed|failed" | head -8
timeout 300 python3 -m harness.bench_offload --warmup 1 --steps 2 --attn flex_attention --target-mib 200 --out $OUT/offload_32b_2048.json --model qwen3-32b --seq-len 2048 2>&1 | grep -v "round 0" | tail -7
timeout 130 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 1024 --variants grouped_mm-split --quiet --no-report 2>&1 | tail -1
cp results/moe/nvidia-h200*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h200*.jsonl
