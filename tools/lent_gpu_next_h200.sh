# Not yet run: the H200 points still missing (issues 4 and 5). About 10 minutes; the sweeps
# resume, so a call cut short keeps what finished.
. tools/lent_gpu_setup.sh || exit 1
timeout 330 python3 -m harness.bench_offload --warmup 1 --steps 2 --attn flex_attention --target-mib 200 --out $OUT/offload_32b_2048.json --model qwen3-32b --seq-len 2048 2>&1 | grep -v "round 0" | tail -6
timeout 250 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 1024 4096 8192 16384 --variants grouped_mm-split stock-grouped_mm --quiet --no-report 2>&1 | tail -2
cp results/moe/nvidia-h200*.jsonl $OUT/
python3 tools/show_rows.py results/moe/nvidia-h200*.jsonl
