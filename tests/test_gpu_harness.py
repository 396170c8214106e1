"""The harness on a real GPU: event-timed points, NVML memory, MFU, a real OOM as a row, and the
H2D benchmark against the PCIe ceiling. Marked gpu: run on a GPU machine."""

from pathlib import Path

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
        # each step's phases tile it: one sample per measured step, and each step's time is its
        # three phases' (the medians need not add up: a host-bound step's phases vary apart)
        phases = [row[k]["samples"] for k in ("forward_ms", "backward_ms", "optimizer_ms")]
        steps = row["step_ms"]["samples"]
        assert len(steps) == exp.measured_steps and all(len(p) == len(steps) for p in phases)
        assert steps == pytest.approx([sum(p) for p in zip(*phases)], rel=1e-3, abs=0.05)
        assert all(t > 0 for p in phases for t in p)
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


def test_nvml_reads_the_gpu_this_process_runs_on():
    # NVML numbers the host's GPUs, CUDA the visible ones: under CUDA_VISIBLE_DEVICES=2 the two
    # disagree, and a point's memory readings must come from its own GPU
    import os
    import subprocess
    import sys

    import pynvml

    pynvml.nvmlInit()
    try:
        host_gpus = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    probe = (
        "import torch, pynvml\n"
        "from harness.measure import env\n"
        "x = torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda')\n"
        "pynvml.nvmlInit()\n"
        "u = pynvml.nvmlDeviceGetUUID(env.nvml_handle(pynvml, 0))\n"
        "pynvml.nvmlShutdown()\n"
        "used, mine = env.nvml_memory_gib(0)\n"
        "print(u == 'GPU-' + str(torch.cuda.get_device_properties(0).uuid), mine)\n"
    )
    pins = [os.environ.get("CUDA_VISIBLE_DEVICES")]
    if pins[0] is None and host_gpus > 1:
        pins.append(str(host_gpus - 1))  # the last GPU: CUDA's device 0, NVML's last
    for pin in pins:
        child = dict(os.environ)
        if pin is not None:
            child["CUDA_VISIBLE_DEVICES"] = pin
        out = subprocess.run([sys.executable, "-c", probe], env=child, capture_output=True, text=True,
                             timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 0, out.stderr[-2000:]
        same, mine = out.stdout.split()
        assert same == "True", f"CUDA_VISIBLE_DEVICES={pin}: NVML read another GPU"
        # the process's own 2 GiB (plus its context) show on the GPU NVML read
        assert mine != "None" and float(mine) >= 2.0, f"CUDA_VISIBLE_DEVICES={pin}: {mine}"


def test_reproduce_names_the_gpu_without_a_cuda_context():
    """`harness reproduce` stays alive while its sweeps run: a context of its own would hold GPU
    memory beside theirs and move where a context search runs out of memory."""
    import subprocess
    import sys

    code = ("import torch\nfrom harness import reproduce\nname, gib = reproduce._gpu()\n"
            "print(name, gib, torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, check=True).stdout.split()
    props = torch.cuda.get_device_properties(0)
    # NVML counts the memory the driver reserves too: within a GiB of what CUDA offers
    assert out[-1] == "False" and " ".join(out[:-2]) == props.name
    assert abs(float(out[-2]) - props.total_memory / 2**30) < 1.0, (out, props.total_memory)
