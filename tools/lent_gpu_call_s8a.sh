# Session 8, first lent-H100 call: optim.graphs' GPU tests on the code changed after session 7's
# runs (peak reset before capture, zero_grad inside GraphedStep), then where gpt-oss-20b's step
# time goes at 8192 tokens, ours and stock (issue 5: the gap shrinks with length; which kernels
# grow?).
. tools/lent_gpu_setup.sh || exit 1
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -p no:cacheprovider 2>&1 | tail -30 > $OUT/pytest-graphs.txt
tail -3 $OUT/pytest-graphs.txt
mkdir -p $OUT/prof
for v in grouped_mm-split-layers-bf16lora stock-grouped_mm; do
  [ $(left) -gt 100 ] || { echo "no time left for $v"; break; }
  timeout $(( $(left) - 20 )) python3 -m harness profile experiments/moe.toml --model gpt-oss-20b --seq-len 8192 --variant $v --out $OUT/prof 2>&1 | grep -v "^USDT\|Warning\|warn" | tail -22
done
