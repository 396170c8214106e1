# Session 6, H100, issue 3 (and the GPU suite after sessions 4-5's changes): the whole GPU test
# suite; m at every length with its host/device split; stock flex at 16384 on Llama-3.2-1B with a
# longer box and stacks every 45 s (in session 5 it ran past 150 s in its first step, no stacks).
. tools/lent_gpu_setup.sh || exit 1
timeout 240 python3 -m pytest -q -m gpu tests > $OUT/gpu-tests.log 2>&1; tail -4 $OUT/gpu-tests.log
timeout 120 python3 -m harness.bench_packing --m-only --out $OUT/packing-m.json > $OUT/packing-m.log 2>&1; tail -9 $OUT/packing-m.log
T=$(( $(left) - 20 ))
PACKBENCH_STACKS_EVERY=45 timeout $((T + 15)) python3 -m harness sweep experiments/packing.toml --models llama-3.2-1b --seq-lens 16384 --variants stock-flex --overwrite --timeout $T --quiet --no-report 2>&1 | tail -1
keep packing
python3 tools/show_rows.py results/packing/nvidia-h100*.jsonl | grep stock-flex
