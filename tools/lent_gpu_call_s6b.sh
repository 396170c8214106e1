# Session 6, H100, issue 5: ours with compiled decoder layers (grouped_mm-split-layers) at the
# gpt-oss lengths where only the uncompiled path ran, each side by side with stock in one run.
. tools/lent_gpu_setup.sh || exit 1
for T in 1024 4096 8192; do
  [ $(left) -gt 120 ] || break
  timeout $(left) python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens $T --variants stock-grouped_mm grouped_mm-split-layers --overwrite --quiet --no-report 2>&1 | tail -1
  keep moe
done
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | grep -- "-layers\|stock-grouped_mm "
