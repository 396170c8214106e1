# Session 5, H100, issue 5: stock (flex + experts grouped_mm + peft) and ours with compiled layers,
# gpt-oss-20b at 2048, side by side in one run (the last of the session's device time).
. tools/lent_gpu_setup.sh || exit 1
timeout 220 python3 -m harness sweep experiments/moe.toml --models gpt-oss-20b --seq-lens 2048 --variants stock-grouped_mm grouped_mm-split-layers --overwrite --launcher preloaded --quiet --no-report 2>&1 | tail -1
mkdir -p $OUT/moe; cp results/moe/nvidia-h100*.jsonl $OUT/moe/
python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl | tail -3
