"""The harness on a real GPU: event-timed points, NVML memory, MFU, a real OOM as a row, and the
H2D benchmark against the PCIe ceiling. Marked gpu: run on a GPU machine."""

import pytest
import torch
from _sweep import small_gpu_experiment

from harness import results as res
from harness.measure import bandwidth
from harness.run import sweep

pytestmark = pytest.mark.gpu

VARIANTS = {"sdpa": {"attn_implementation": "sdpa"}, "flex": {"attn_implementation": "flex_attention"}}


def test_point_on_gpu_records_events_memory_and_mfu(tmp_path):
    exp = small_gpu_experiment("gpu-check", VARIANTS)
    summary = sweep.run(exp, tmp_path, progress=False)
    assert summary.statuses == {"ok": 2}
    for row in res.read_rows(summary.results_path):
        assert row["device_type"] == "cuda" and row["dtype_used"] == "bfloat16"
        phases = sum(row[k]["p50"] for k in ("forward_ms", "backward_ms", "optimizer_ms"))
        assert row["step_ms"]["p50"] == pytest.approx(phases, rel=0.15)
        assert 0 < row["peak_allocated_gib"] <= row["peak_reserved_gib"]
        assert row["nvml_device_used_gib"] >= row["peak_reserved_gib"] * 0.9
        assert 0 < row["mfu"] < row["hfu"] < 1
        assert row["env"]["device_name"].startswith("NVIDIA") and row["env"]["driver"]
        assert all(torch.isfinite(torch.tensor(row["loss"])))


def test_real_oom_is_a_row_and_the_sweep_goes_on(tmp_path):
    # 64 rows x 32768 tokens of a 151936-word vocabulary: the logits alone need terabytes
    exp = small_gpu_experiment("gpu-check", VARIANTS, seq_lens=[32768], batch_size=64)
    summary = sweep.run(exp, tmp_path, progress=False)
    rows = res.read_rows(summary.results_path)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"oom"}
    assert all("out of memory" in r["message"].lower() for r in rows)


def test_bandwidth_pinned_beats_pageable_and_stays_under_pcie():
    rows = bandwidth.measure_h2d(sizes=[2**20, 2**26], repeats=5)
    by = {(r["memory"], r["size_bytes"]): r for r in rows}
    big_pinned = by[("pinned", 2**26)]["gbps"]["p50"]
    big_pageable = by[("pageable", 2**26)]["gbps"]["p50"]
    assert big_pinned > big_pageable
    ceiling = rows[0]["pcie_ceiling_gbps"]
    assert ceiling is None or big_pinned < ceiling * 1.05
