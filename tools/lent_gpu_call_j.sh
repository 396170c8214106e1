# Session 3, first lent-H100 call (issue 5): where gpt-oss-20b's step time goes (profile of ours
# and stock at 2048), then the 16384-token points (ours, then stock) with room for the build.
. tools/lent_gpu_setup.sh || exit 1
mkdir -p $OUT/prof
for v in grouped_mm-split stock-grouped_mm; do
  timeout 170 python3 -m harness profile experiments/moe.toml --model gpt-oss-20b --seq-len 2048 --variant $v --out $OUT/prof 2>&1 | grep -v "^USDT\|Warning\|warn" | tail -22
done
timeout 240 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants grouped_mm-split --quiet --no-report 2>&1 | tail -2
timeout 200 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 16384 --variants stock-grouped_mm --quiet --no-report 2>&1 | tail -2
cp results/moe/nvidia-h100*.jsonl $OUT/
tar czf $OUT/prof.tgz -C $OUT prof && rm -rf $OUT/prof
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl
