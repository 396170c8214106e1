# Not yet run. Issue 5: ours with compiled decoder layers (grouped_mm-split-layers) at the gpt-oss
# lengths where only the uncompiled path ran, each side by side with stock in one run.
. tools/lent_gpu_setup.sh || exit 1
for T in 1024 4096 8192; do
  timeout 180 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens $T --variants stock-grouped_mm grouped_mm-split-layers --overwrite --launcher preloaded --quiet --no-report 2>&1 | tail -1
  mkdir -p $OUT/moe; cp results/moe/nvidia-h100*.jsonl $OUT/moe/
done
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | tail -8
# Does Qwen3-30B-A3B train on one H100 with bf16 adapters? (report: ~3.6 GiB left, ~3,200 tokens)
timeout 200 python3 -m harness sweep experiments/moe.toml --models qwen3-30b-a3b --seq-lens 1024 2048 --variants grouped_mm-split-bf16lora --launcher preloaded --quiet --no-report 2>&1 | tail -1
cp results/moe/nvidia-h100*.jsonl $OUT/moe/
