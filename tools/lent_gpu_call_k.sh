# Session 3, second lent-H100 call (issue 5): the compiled grouped_mm experts (moe_compile) —
# GPU numerics against the loop, then gpt-oss-20b at 2048 compiled vs eager side by side, and
# where the compiled step's time goes.
. tools/lent_gpu_setup.sh || exit 1
mkdir -p $OUT/prof
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_moe.py 2>&1 | tail -4
timeout 330 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants grouped_mm-split grouped_mm-split-eager --overwrite --quiet --no-report 2>&1 | tail -2
cp results/moe/nvidia-h100*.jsonl $OUT/
timeout 150 python3 -m harness profile experiments/moe.toml --model gpt-oss-20b --seq-len 2048 --variant grouped_mm-split --out $OUT/prof 2>&1 | grep -v "^USDT\|Warning\|warn" | tail -16
tar czf $OUT/prof.tgz -C $OUT prof && rm -rf $OUT/prof
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep " 2048 "
