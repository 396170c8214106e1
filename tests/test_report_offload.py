"""The offload section: side-by-side modes, the (L−1)·min(c,g) overlap model, targets."""

from __future__ import annotations

import pytest
from _report import (
    MIB,
    _offload_point,
    _offload_rows,
    keep_experiment,
    spec,
    store,
)

from harness import report
from harness.report import fmt, offload


@pytest.fixture
def offload_readme(tmp_path) -> str:
    store(tmp_path / "results", "offload", _offload_rows())
    keep_experiment(tmp_path / "results", "offload")
    return report.build_report(tmp_path / "results", "offload", tmp_path / "reports").read_text()


def _points():
    return {p["model"]: p for p in offload.offload_points(_offload_rows())}


def test_offload_step_and_overlap_tables(offload_readme):
    assert "`results/offload/nvidia-h100-80gb-hbm3.jsonl`" in offload_readme  # the rows it read, named
    pts = _points()
    eight, fourteen, small = pts["qwen3-8b"], pts["qwen3-14b"], pts["llama-3.2-1b"]
    assert eight["p50"] == {"none": 1750.0, "single": 2000.0, "double": 1800.0, "save_on_cpu": 2100.0}
    assert eight["peak"] == {"none": 30.0, "single": 24.9375, "double": 25.0, "save_on_cpu": 25.5}
    # c = 20, g = 30, n = 33: (n−1)·min(c, g) = 640 ms predicted; single − double = 200 ms measured
    assert (eight["c"], eight["g"], eight["n"], eight["predicted"], eight["measured"]) == (20.0, 30.0, 33, 640.0, 200.0)
    assert eight["ratio"] == pytest.approx(200 / 640)
    assert not offload.RATIO_OK[0] <= eight["ratio"] <= offload.RATIO_OK[1]  # flagged ⚠ where shown
    # 2000/1800 − 1 = +11.1%; the file's model figure; per layer 100·20/(20+30) = 40%
    assert (eight["double_over_single_pct"], eight["model_pct"], eight["per_layer_bound_pct"]) == \
        (pytest.approx(100 * (2000 / 1800 - 1)), 47.06, pytest.approx(40.0))
    assert (eight["double_vs_none_pct"], eight["double_over_soc_pct"]) == \
        (pytest.approx(100 * (1800 / 1750 - 1)), pytest.approx(100 * (2100 / 1800 - 1)))
    assert (eight["buffer_gib"], eight["layer_gib"], eight["saved_vs_none_gib"]) == (0.0625, 0.0625, 5.0)
    assert (eight["trace"]["overlap_pct"], eight["trace"]["h2d_pinned"], eight["trace"]["h2d_count"]) == (97.5, 32, 32)
    assert fourteen["ratio"] == pytest.approx(50 / 76) and fourteen["trace"] == {}  # no trace
    # missing fields are None (rendered "–"), and the points sort naturally (8b before 14b)
    assert all(small[k] is None for k in ("c", "g", "n", "predicted", "measured", "ratio", "layer_gib"))
    assert [p["model"] for p in offload.offload_points(_offload_rows())] == ["llama-3.2-1b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
    with fmt.recording() as tables:
        offload.offload_tables(offload.offload_points(_offload_rows()), _offload_rows())
    shown = tables.find("c ms (bytes / pinned BW)").row(model="qwen3-8b")
    assert (shown["measured / predicted"], shown["VRAM saved vs none GiB"]) == (pytest.approx(200 / 640), 5.0)
    failed = [r for p in offload.offload_points(_offload_rows()) for r in p["failed"]]
    assert [(r["model"], r["mode"], r["status"]) for r in failed] == [("qwen3-32b", "build", "oom")]


def test_offload_targets_pass_fail_and_unreachable():
    points = offload.offload_points(_offload_rows())
    rows = {t["target"]: (fmt.value(t["measured"]), t["ok"], t["note"])
            for t in offload.offload_targets(points, spec("offload")["seeds"])}
    # 640/(2000−640) = +47.1% bound at 8B; 14B: 76/(5000−76) = +1.5% < the published +6.7%
    assert rows["double over single ≥ +8.4% (qwen3-8b T=2048 B=4)"] == \
        ((pytest.approx(100 * (2000 / 1800 - 1)), pytest.approx(100 * 640 / 1360)), True, "")
    assert rows["double over single ≥ +6.7% (qwen3-14b T=8192 B=1)"] == \
        ((pytest.approx(100 * (5000 / 4950 - 1)), pytest.approx(100 * 76 / 4924)), False,
         "unreachable: bound +1.5% < +6.7%")
    assert rows["second buffer ≤ one layer input (qwen3-8b T=2048 B=4)"][1] is True
    assert rows["second buffer ≤ one layer input (qwen3-14b T=8192 B=1)"][1] is False  # peak +0.2 GiB > 80 MiB
    assert rows["second buffer ≤ one layer input (llama-3.2-1b T=1024 B=2)"] == ("–", None, "")
    assert rows["double within 5% of none, peak below none (llama-3.2-1b T=1024 B=2)"] == ("–", None, "")
    assert rows["double within 5% of none, peak below none (qwen3-8b T=2048 B=4)"][1] is True
    assert rows["double within 5% of none, peak below none (qwen3-14b T=8192 B=1)"] == \
        ((pytest.approx(100 * (4950 / 4500 - 1)), 30.2, 40.0), False, "")
    # 4900 < 4950: double is slower than save_on_cpu at the 14B point
    assert rows["double faster than save_on_cpu at every point"] == \
        ((pytest.approx(100 * (4900 / 4950 - 1)), pytest.approx(100 * (2100 / 1800 - 1)), 2), False, "")
    assert not any("llama-3.2-1b" in k and "double over single" in k for k in rows)
    # the bound the paragraph under the targets works through, point by point
    fourteen = next(p for p in points if p["model"] == "qwen3-14b")
    assert (fourteen["n"], min(fourteen["c"], fourteen["g"]), fourteen["p50"]["single"]) == (39, 2.0, 5000.0)
    assert fourteen["bound_pct"] == pytest.approx(100 * 76 / 4924)


def test_offload_bound_reachable_everywhere():
    rows = _offload_point("qwen3-8b", 2048, 4, 64 * MIB, {"single": 2000.0, "double": 1700.0},
                          {"single": 1.0, "double": 1.0}, {"layers_reloaded": 33, "c_ms": 20.0, "g_ms": 30.0})
    points = offload.offload_points(rows)
    (gain,) = [t for t in offload.offload_targets(points, spec("offload")["seeds"]) if t["target"].startswith("double over single")]
    assert gain["ok"] is True and gain["note"] == ""
    assert offload.offload_bound_paragraph(points, spec("offload")["seeds"])  # its wording: the report snapshot


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
