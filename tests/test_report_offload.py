"""The offload section: side-by-side modes, the (L−1)·min(c,g) overlap model, targets."""

from __future__ import annotations

import pytest
from _report import (
    MIB,
    _cells,
    _offload_point,
    _offload_rows,
    _section,
    keep_experiment,
    spec,
    store,
)

from harness import report
from harness.report import offload


@pytest.fixture
def offload_readme(tmp_path) -> str:
    store(tmp_path / "results", "offload", _offload_rows())
    keep_experiment(tmp_path / "results", "offload")
    return report.build_report(tmp_path / "results", "offload", tmp_path / "reports").read_text()


def test_offload_step_and_overlap_tables(offload_readme):
    side = _section(offload_readme, "## Side-by-side benchmark (one process)")
    assert "### NVIDIA H100 80GB HBM3 (`nvidia-h100-80gb-hbm3`)" in side
    assert "`results/offload/nvidia-h100-80gb-hbm3.jsonl`" in side
    steps = _cells(side, "| qwen3-8b | 2048 | 4 | 64 |")
    assert steps[4:8] == ["1750.0 [1749.0–1752.0]", "2000.0 [1999.0–2002.0]", "1800.0 [1799.0–1802.0]",
                          "2100.0 [2099.0–2102.0]"]
    assert steps[8] == "30.00 / 24.94 / 25.00 / 25.50"
    model = _section(side, "#### Offloaded checkpointing: overlap model")
    cells = _cells(model, "| qwen3-8b | 2048 | 4 | 64 |")
    assert cells[4:7] == ["20.0 (19.5 @ 3.4 GB/s)", "30.0", "33"]
    assert cells[7:9] == ["640.0", "200.0"]
    assert cells[9] == "0.31 ⚠"  # 200 / 640, outside 0.5–1.5
    # 2000/1800 − 1 = +11.1%; the file's model figure; per layer 100·20/(20+30) = 40%.
    assert cells[10] == "+11.1% (model +47.1%, per layer ≤ 40.0%)"
    assert cells[11:13] == ["+2.9%", "+16.7%"]  # 1800/1750 − 1; 2100/1800 − 1
    assert cells[13] == "0.062 (peak +0.063) / 0.062"
    assert cells[14:] == ["5.00", "97.5%", "32/32"]
    fourteen = _cells(model, "| qwen3-14b | 8192 | 1 | 80 |")
    assert fourteen[9] == "0.66"  # 50 / 76, no flag
    assert fourteen[15:] == ["–", "–"]  # no trace
    # Missing fields render as "–", and the model sort is natural (8b before 14b).
    small = _cells(model, "| llama-3.2-1b | 1024 | 2 | – |")
    assert small[4:10] == ["– (–)", "–", "–", "–", "–", "–"]
    assert model.index("| qwen3-8b |") < model.index("| qwen3-14b |")
    assert "qwen3-32b T=8192 B=2 build: oom (CUDA out of memory. Tried to allocate 2 GiB)" in side


def test_offload_targets_pass_fail_and_unreachable(offload_readme):
    targets = _section(offload_readme, "## Targets")
    rows = {}
    for line in targets.splitlines():
        if line.startswith("| ") and not line.startswith("| target |"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    assert rows["double over single ≥ +8.4% (qwen3-8b T=2048 B=4)"] == [
        "+8.4% (0.3739→0.4053 steps/s, 8B, B200)", "+11.1% (bound +47.1%)", "yes"]  # 640/(2000−640)
    assert rows["double over single ≥ +6.7% (qwen3-14b T=8192 B=1)"] == [
        "+6.7% (0.2245→0.2395 steps/s, 14B, B200)", "+1.0% (bound +1.5%)", "no (unreachable: bound +1.5% < +6.7%)"]
    assert rows["second buffer ≤ one layer input (qwen3-8b T=2048 B=4)"][2] == "yes"
    assert rows["second buffer ≤ one layer input (qwen3-14b T=8192 B=1)"][2] == "no"  # peak +0.2 GiB > 80 MiB
    assert rows["second buffer ≤ one layer input (llama-3.2-1b T=1024 B=2)"] == ["–", "–", "–"]
    assert rows["double within 5% of none, peak below none (llama-3.2-1b T=1024 B=2)"] == ["–", "–", "–"]
    assert rows["double within 5% of none, peak below none (qwen3-8b T=2048 B=4)"][2] == "yes"
    assert rows["double within 5% of none, peak below none (qwen3-14b T=8192 B=1)"][1:] == [
        "step +10.0%, peak 30.20 vs 40.00 GiB", "no"]
    # 4900 < 4950: double is slower than save_on_cpu at the 14B point.
    assert rows["double faster than save_on_cpu at every point"][1:] == ["-1.0% … +16.7% over 2 points", "no"]
    assert not any("llama-3.2-1b" in k and "double over single" in k for k in rows)
    para = targets.split("\n\n")[-1]
    assert para.startswith("Double buffering can at best hide min(c, g)")
    assert "qwen3-14b T=8192 B=1: (39−1)·2.00 ms / 5000.0 ms → +1.5%" in para
    assert "not reachable where the bound is below it: qwen3-14b T=8192 B=1 (bound +1.5% < +6.7%)." in para
    assert "qwen3-8b T=2048 B=4 (bound" not in para


def test_offload_bound_reachable_everywhere():
    rows = _offload_point("qwen3-8b", 2048, 4, 64 * MIB, {"single": 2000.0, "double": 1700.0},
                          {"single": 1.0, "double": 1.0}, {"layers_reloaded": 33, "c_ms": 20.0, "g_ms": 30.0})
    points = offload.offload_points(rows)
    (gain,) = [t for t in offload.offload_targets(points, spec("offload")["seeds"]) if t["target"].startswith("double over single")]
    assert gain["ok"] is True and gain["note"] == ""
    assert "reachable in principle" in offload.offload_bound_paragraph(points, spec("offload")["seeds"])


def test_two_gpus_offload_rows_stay_two_points_each_named():
    """The bench keys its rows by model, length and batch: the README reads both GPUs' rows at
    once, and an H100's point must not take the H200's modes (or hide behind them)."""
    def on(gpu: str, double_ms: float) -> list[dict]:
        rows = _offload_point("qwen3-8b", 2048, 4, 64 * MIB, {"single": 2000.0, "double": double_ms},
                              {"single": 1.0, "double": 1.0}, {"layers_reloaded": 33, "c_ms": 20.0, "g_ms": 30.0})
        return [{**r, "gpu_slug": gpu.lower().replace(" ", "-"), "device_name": gpu} for r in rows]

    points = offload.offload_points(on("NVIDIA H100 80GB HBM3", 1900.0) + on("NVIDIA H200", 1600.0))
    assert [p["modes"]["double"]["device_name"] for p in points] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    gains = {t["target"]: t["measured"] for t in offload.offload_targets(points, spec("offload")["seeds"])
             if t["target"].startswith("double over single")}
    # 2000/1900 − 1 = +5.3 % on the one, 2000/1600 − 1 = +25.0 % on the other
    assert gains["double over single ≥ +8.4% (qwen3-8b T=2048 B=4, NVIDIA H100 80GB HBM3)"].startswith("+5.3%")
    assert gains["double over single ≥ +8.4% (qwen3-8b T=2048 B=4, NVIDIA H200)"].startswith("+25.0%")
    (alone,) = offload.offload_points(on("NVIDIA H200", 1600.0))
    assert not alone["named_gpu"]  # one GPU's rows: labels as before
