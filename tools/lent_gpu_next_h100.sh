# Not yet run (session 5 spent its device time on the packing grid). Issue 3: what is still
# missing after calls w-z4: m at 16384 (and m's host/device split at every length, for the
# cache-gain explanation), stock flex at 16384 (both small models ran past 150 s in their first
# step with no stacks in the log; this run's log says whether SIGUSR1 got an answer), Qwen3-14B
# stock flex at 16384. Then the regional GPU tests after the window fix. Issue 5: compiled layers
# at the other gpt-oss lengths, side by side with stock.
. tools/lent_gpu_setup.sh || exit 1
python3 -m harness.bench_packing --m-only --out $OUT/packing-m.json 2>&1 | tee $OUT/packing-m.log | head -12
# commit $OUT/packing-m.json as results/packing-bench/nvidia-h100-80gb-hbm3.bench.json (it supersedes the .m.log)
timeout 200 python3 -m harness sweep experiments/packing.toml --models llama-3.2-1b --seq-lens 16384 --variants stock-flex --overwrite --timeout 150 --launcher preloaded --quiet --no-report 2>&1 | tail -1
tar czf $OUT/logs.tgz results/packing/logs
timeout 200 python3 -m harness sweep experiments/packing.toml --models qwen3-14b --seq-lens 16384 --variants stock-flex --timeout 150 --launcher preloaded --quiet --no-report 2>&1 | tail -1
cp results/packing/nvidia-h100*.jsonl $OUT/; tar czf $OUT/logs.tgz results/packing/logs
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_regional.py 2>&1 | tail -3
