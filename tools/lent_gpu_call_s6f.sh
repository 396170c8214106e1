# Session 6, H100, issue 3: the whole packing bench in one run, so results/packing-bench holds the
# structure builds and device-to-host syncs per training step (cache on vs off, counted with
# torch.cuda.set_sync_debug_mode) beside m; call s6e ran m alone (--m-only).
. tools/lent_gpu_setup.sh || exit 1
timeout 420 python3 -m harness.bench_packing --out $OUT/packing-bench.json > $OUT/packing-bench.log 2>&1; echo rc=$?
grep -v "^m " $OUT/packing-bench.log | tail -32
