# Session 6, H100: m again with the build's device time measured behind a spin kernel (call s6a's
# device time was taken on an idle GPU, so it counted the host's gaps too: device ~ host); the
# GPU tests that call s6a's 240 s box did not reach (test_gpu_packing after its first, regional).
. tools/lent_gpu_setup.sh || exit 1
timeout 120 python3 -m harness.bench_packing --m-only --out $OUT/packing-m.json > $OUT/packing-m.log 2>&1; tail -3 $OUT/packing-m.log
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/packing-m.json")):
    if not r["from_position_ids"]:
        print(f'{r["backend"]:7s}{r["seq_len"]:6d}  m {r["m_ms"]:.3f}  host {r["m_host_ms"]:.3f}  device {r["m_device_ms"]:.3f}')
PY
timeout $(left) python3 -m pytest -v -m gpu tests/test_gpu_packing.py tests/test_gpu_regional.py --durations=0 > $OUT/gpu-tests.log 2>&1; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/gpu-tests.log | cut -c1-150 | tail -16
