"""The packing sections: m, builds per step, the cache's saving against (L−1)·m, packed against stock."""

from __future__ import annotations

import pytest

from _report import spec

from harness.report import bench, fmt

SPEC = spec("packing")


def test_packing_cache_predicted_vs_measured():
    from harness.report.packing import packing_cache_points

    def row(cache, p50, builds):
        return {"kind": "step", "status": "ok", "gpu_slug": "g", "model": "qwen3-0.6b", "seq_len": 8192,
                "num_layers": 28, "measured_steps": 10, "step_ms": {"p20": p50, "p50": p50, "p80": p50},
                "switches": {"packing_backend": "varlen", "packing_cache": cache},
                "packing_counters": {"varlen_args": builds, "metadata": builds}}

    m = [{"kind": "packing_m", "gpu_slug": "g", "backend": "varlen", "seq_len": 8192,
          "from_position_ids": False, "m_ms": 0.5, "window": None, "sinks": False},
         {"kind": "packing_m", "gpu_slug": "other", "backend": "varlen", "seq_len": 8192,
          "from_position_ids": False, "m_ms": 9.0, "window": None, "sinks": False}]
    (p,) = packing_cache_points([row(True, 400.0, 10), row(False, 430.0, 560)], m)
    assert (p["builds_on"], p["builds_off"], p["m_ms"]) == (1.0, 56.0, 0.5)
    assert p["predicted_ms"] == pytest.approx(27.5) and p["seeds_ms"] == pytest.approx(13.5)
    assert p["measured_ms"] == pytest.approx(30.0) and p["ratio"] == pytest.approx(30 / 27.5)
    assert p["gain_pct"] == pytest.approx(7.5)
    assert p["predicted_device_ms"] is None  # this bench row has no device split
    # a point measured with the cache on only gives no row
    assert packing_cache_points([row(True, 400.0, 10)], m) == []
    # with the device part of m recorded: what a GPU-bound step must still pay per rebuild
    m[0]["m_device_ms"] = 0.1
    (p,) = packing_cache_points([row(True, 400.0, 10), row(False, 430.0, 560)], m)
    assert p["predicted_device_ms"] == pytest.approx(5.5)
    assert p["ratio_device"] == pytest.approx(30 / 5.5)


def test_packing_cache_md_sorts_pairs_by_who_bounds_the_step():
    from harness.report.packing import bound_split, packing_cache_points

    def row(t, cache, p50, spread, builds):
        return {"kind": "step", "status": "ok", "gpu_slug": "g", "model": "qwen3-0.6b", "seq_len": t,
                "num_layers": 28, "measured_steps": 10,
                "step_ms": {"p20": p50, "p50": p50, "p80": p50 * spread},
                "switches": {"packing_backend": "flex", "packing_cache": cache},
                "packing_counters": {"flex_block_mask": builds}}

    m = [{"kind": "packing_m", "gpu_slug": "g", "backend": "flex", "seq_len": t, "from_position_ids": False,
          "m_ms": 2.5, "m_device_ms": 0.3, "window": None, "sinks": False} for t in (2048, 8192, 16384)]
    rows = [row(16384, True, 700.0, 1.001, 10), row(16384, False, 716.0, 1.001, 560),   # GPU-bound
            row(8192, True, 700.0, 1.04, 10), row(8192, False, 701.0, 1.04, 560),       # within its band
            row(2048, True, 400.0, 1.2, 10), row(2048, False, 530.0, 1.2, 560)]         # host-bound
    split = bound_split(packing_cache_points(rows, m))
    # 16 ms saved of a 16.5 ms device part; 2048: 130 ms of 137.5 ms predicted from the whole m
    assert split["gpu"] == [pytest.approx(16 / 16.5)] and split["small"] == 1
    assert split["host"] == [pytest.approx(130 / 137.5)]


def test_packing_cache_md_names_lengths_without_m():
    from harness.report.packing import packing_cache_md, packing_cache_points

    rows = [_packing_row("packed-flex", 400.0, seq_len=16384), _packing_row("packed-flex-nocache", 410.0, seq_len=16384)]
    (p,) = packing_cache_points(rows, [])
    assert (p["seq_len"], p["m_ms"], p["predicted_ms"], p["measured_ms"]) == (16384, None, None, 10.0)
    with fmt.recording() as tables:
        packing_cache_md(rows, [], SPEC)
    shown = tables.find("device part of it ms").row(model="qwen3-0.6b", seq_len=16384)
    assert (shown["m ms"], shown["predicted (off − on)·m ms"], shown["measured saving ms"]) == (None, None, 10.0)


def _packing_row(variant, p50, *, model="qwen3-0.6b", seq_len=8192, status="ok", peak=None,
                 at="2026-11-22T00:30:00+00:00", sha="aaaa1111", spread=1.0, **switches) -> dict:
    backend = "off" if variant.startswith("stock-") else variant.split("-")[1]
    sw = {"packing_backend": backend, **switches}
    if variant.endswith("-compiled"):
        sw["compile_layers"] = True
    if variant.startswith("packed-") and not variant.endswith("-compiled"):
        sw.setdefault("packing_cache", not variant.endswith("-nocache"))
    return {"kind": "step", "gpu_slug": "g", "model": model, "seq_len": seq_len, "variant": variant,
            "role": "stock" if variant.startswith("stock-") else "ours", "status": status, "switches": sw, "batch_size": 1, "num_layers": 28, "measured_steps": 10,
            "step_ms": {"p20": p50, "p50": p50, "p80": p50 * spread} if status == "ok" else None,
            "peak_allocated_gib": peak, "recorded_at": at, "env": {"git_sha": sha}}


def _targets(rows, m_rows=()):
    """packing_targets_md's tables as data: {target: (measured, result)} and every table."""
    from harness.report.packing import packing_targets_md

    with fmt.recording() as tables:
        packing_targets_md(rows, list(m_rows), SPEC)
    targets = {r["target"]: (r["measured"], r["result"]) for t in tables if t.header == ["target", "measured", "result"]
               for r in t.rows()}
    return targets, tables


SPEEDUP = (f"best packed path ≥ {SPEC['speedup']['min_ratio']:g}× faster than stock-flex, qwen3-0.6b at 8192 tokens "
           "(REFERENCE: stock 411 ms on the H100)")


def test_packing_cache_compiled_rows_do_not_collide():
    from harness.report.packing import packing_cache_md, packing_cache_points

    # compiled rows that record the cache default must not become the "on" row of the uncompiled pair
    rows = [_packing_row("packed-flex-compiled", 200.0, packing_cache=True),
            _packing_row("packed-flex", 400.0), _packing_row("packed-flex-nocache", 500.0)]
    (p,) = packing_cache_points(rows, [])
    assert (p["compiled"], p["on_ms"], p["off_ms"]) == (False, 400.0, 500.0)
    # a compiled on/off pair, should one be run, is its own point with its own label
    rows.append(_packing_row("packed-flex-compiled", 260.0, packing_cache=False))
    pts = packing_cache_points(rows, [])
    assert [(q["compiled"], q["on_ms"], q["off_ms"]) for q in pts] == [(False, 400.0, 500.0), (True, 200.0, 260.0)]
    with fmt.recording() as tables:
        packing_cache_md(rows, [], SPEC)
    assert tables.find("structure builds / step on / off").column("backend") == ["flex", "flex (compiled)"]


def test_packing_best_packed_vs_stock_flex_met():
    from harness.report.packing import packing_vs_stock_points

    rows = [_packing_row("stock-flex", 500.0, at="2026-11-22T00:30:00+00:00"),
            _packing_row("stock-flex-compiled", 250.0),
            _packing_row("packed-flex", 400.0),
            _packing_row("packed-sdpa", None, status="oom"),
            _packing_row("packed-varlen-compiled", 200.0, at="2026-11-22T00:40:00+00:00"),
            _packing_row("stock-flex", 300.0, seq_len=2048)]  # no packed row at 2048
    at_2048, at_8192 = packing_vs_stock_points(rows, SPEC)
    assert (at_8192["stock_ms"], at_8192["best_ms"], at_8192["best_variant"]) == (500.0, 200.0, "packed-varlen-compiled")
    assert at_8192["ratio"] == pytest.approx(2.5) and at_8192["compiled_ratio"] == pytest.approx(1.25)
    assert at_8192["failed"] == ["packed-sdpa: oom"]
    assert at_8192["run"] == (10.0, True, True)  # 10 minutes apart, one code: one run
    assert (at_2048["stock_ms"], at_2048["best_ms"], at_2048["ratio"], at_2048["run"]) == (300.0, None, None, None)
    # the target's verdict, from the experiment file's min_ratio
    targets, _ = _targets(rows)
    measured, result = targets[SPEEDUP]
    assert measured == {"ratio": pytest.approx(2.5), "stock_ms": 500.0, "best_variant": "packed-varlen-compiled",
                        "best_ms": 200.0, "compiled_ratio": pytest.approx(1.25)} and result is True


def test_packing_best_packed_vs_stock_flex_not_met_and_different_runs():
    from harness.report.packing import packing_vs_stock_points

    rows = [_packing_row("stock-flex", 500.0, at="2026-11-21T20:00:00+00:00"),
            _packing_row("packed-flex", 450.0, at="2026-11-22T00:00:00+00:00")]
    measured, result = _targets(rows)[0][SPEEDUP]
    assert (measured["ratio"], measured["compiled_ratio"], result) == (pytest.approx(500 / 450), None, False)
    assert packing_vs_stock_points(rows, SPEC)[0]["run"] == (240.0, True, False)
    # within 30 minutes but at another commit: still different runs
    rows[1].update(recorded_at="2026-11-21T20:05:00+00:00", env={"git_sha": "bbbb2222"})
    assert packing_vs_stock_points(rows, SPEC)[0]["run"] == (5.0, False, False)
    # different commits but one hash of the measuring code (a commit that added only results): one run
    rows[0]["env"] = {"git_sha": "aaaa1111", "code_sha": "c0de"}
    rows[1]["env"] = {"git_sha": "bbbb2222", "code_sha": "c0de"}
    assert packing_vs_stock_points(rows, SPEC)[0]["run"] == (5.0, True, True)


def test_packing_targets_missing_stock_flex_and_odd_rows():
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-varlen", 380.0, peak=15.0),
            {"kind": "step"}, {"kind": "step", "variant": "stock-flex", "status": "ok", "step_ms": "fast"},
            {"kind": "step", "variant": "packed-sdpa", "model": "qwen3-0.6b", "seq_len": "8192", "status": "ok",
             "switches": None, "recorded_at": None, "peak_allocated_gib": float("nan")}]
    md = packing_targets_md(rows, [], SPEC)
    assert "None" not in md and "nan" not in md  # odd fields render as –, whatever the wording
    targets, tables = _targets(rows)
    assert targets[SPEEDUP] == ("not measured", None)
    assert not [t for t in tables if "best packed ms p50 (variant)" in t.header]  # no stock-flex row: no table
    peaks = tables.find("bool B·T² mask GiB").row(GPU="g", model="qwen3-0.6b", tokens=8192)
    assert [peaks[k] for k in ("packed sdpa GiB", "packed flex GiB", "packed varlen GiB", "one run?")] == [None, None, 15.0, True]
    assert peaks["bool B·T² mask GiB"] == pytest.approx(8192**2 / 2**30)
    # a stock-flex row but no packed row at all: stated, not judged
    assert _targets([_packing_row("stock-flex", 500.0)])[0][SPEEDUP] == ({"stock_ms": 500.0}, None)
    # and nothing at all still renders the target lines
    assert set(_targets([])[0].values()) == {("not measured", None)}
    assert bench.sweep_targets({"packing": SPEC}, [{"kind": "step"}]) != []


def test_packing_cache_gain_vs_seeds():
    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-flex-nocache", 500.0),  # +25%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 420.0),  # +5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b"),
            _packing_row("packed-sdpa-nocache", 303.0, model="llama-3.2-1b")]  # +1%
    targets, _ = _targets(rows)
    qwen = targets["cache on saves ≥ the published +14.8% per step (qwen3-0.6b)"]
    assert qwen == ({"gain_pct": pytest.approx(25.0), "backend": "flex", "seq_len": 8192, "spread_pct": 0.0}, True)
    llama = targets["cache on saves ≥ the published +11.5% per step (llama-3.2-1b)"]
    assert llama == ({"gain_pct": pytest.approx(1.0), "backend": "sdpa", "seq_len": 8192, "spread_pct": 0.0}, False)
    assert targets["cache on saves ≥ the published +14.3% per step (qwen3-14b)"] == ("not measured", None)


def test_packing_cache_gain_within_noise_is_not_judged():
    """Host-bound rows: a gain smaller than the rows' own p80/p20 spread measures nothing; the
    largest gain that clears its spread is the one judged."""
    rows = [_packing_row("packed-flex", 400.0, spread=1.4), _packing_row("packed-flex-nocache", 500.0),  # +25% < 40%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 440.0, spread=1.05),  # +10% > 5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b", spread=1.3),
            _packing_row("packed-sdpa-nocache", 330.0, model="llama-3.2-1b")]  # +10% < 30%
    targets, _ = _targets(rows)
    qwen = targets["cache on saves ≥ the published +14.8% per step (qwen3-0.6b)"]
    assert (qwen[0]["gain_pct"], qwen[0]["backend"], qwen[0]["spread_pct"], qwen[1]) == \
        (pytest.approx(10.0), "varlen", pytest.approx(5.0), False)
    llama = targets["cache on saves ≥ the published +11.5% per step (llama-3.2-1b)"]
    assert (llama[0]["gain_pct"], llama[0]["spread_pct"], llama[1]) == (pytest.approx(10.0), pytest.approx(30.0), None)


def test_packing_peak_memory_side_by_side():
    rows = [_packing_row("packed-sdpa", 410.0, peak=15.8), _packing_row("packed-flex", 400.0, peak=15.7),
            _packing_row("packed-varlen", 390.0, peak=15.75, at="2026-11-22T02:00:00+00:00"),
            _packing_row("packed-flex-compiled", 200.0, peak=1.0)]  # compiled: not in this table
    peaks = _targets(rows)[1].find("bool B·T² mask GiB").row(GPU="g", model="qwen3-0.6b", tokens=8192)
    assert [peaks[k] for k in ("packed sdpa GiB", "packed flex GiB", "packed varlen GiB")] == [15.8, 15.7, 15.75]
    assert peaks["sdpa − flex / sdpa − varlen GiB"] == (pytest.approx(0.1), pytest.approx(0.05))
    assert peaks["one run?"] is False  # 90 minutes apart


def test_packing_vs_stock_keeps_a_point_whose_stock_run_failed():
    failed = _packing_row("stock-flex", None, seq_len=16384, status="error")
    failed["message"] = "timed out after 150 s"
    _, tables = _targets([failed, _packing_row("packed-flex", 700.0, seq_len=16384)])
    p = tables.find("best packed ms p50 (variant)").row(GPU="g", model="qwen3-0.6b", tokens=16384)
    assert (p["stock-flex ms p50"], p["best packed ms p50 (variant)"], p["stock-flex / best"]) == \
        ("error: timed out after 150 s", (700.0, "packed-flex"), None)


def test_best_packed_path_counts_optim_enable_defaults():
    """optim.enable() picks its packing backend itself, so its row names none: what ran (optim's packed
    attention) makes it a packed path. A peer on stock attention is never one."""
    from harness.report.packing import packing_vs_stock_points

    base = _packing_row("packed-flex", 0.0)
    user = {**base, "variant": "user", "step_ms": {"p20": 190.0, "p50": 190.0, "p80": 190.0},
            "switches": {"gradient_checkpointing": True}, "role": "ours-default",
            "attn_implementation_used": "optim_packed"}
    liger = {**base, "variant": "liger", "step_ms": {"p20": 150.0, "p50": 150.0, "p80": 150.0},
             "switches": {}, "role": "peer", "attn_implementation_used": "flex_attention"}
    rows = [_packing_row("stock-flex", 430.0), _packing_row("packed-flex-compiled", 220.0), user, liger]
    (p,) = packing_vs_stock_points(rows, SPEC)
    assert (p["best_variant"], p["best_ms"]) == ("user", 190.0)
    assert p["ratio"] == pytest.approx(430.0 / 190.0)


def test_packing_comparisons_follow_the_experiment_file():
    from harness.report.packing import packing_vs_stock_points

    rows = [_packing_row("stock-flex", 500.0), _packing_row("packed-flex", 400.0)]
    renamed = [{**r, "variant": "stock-flex-v2"} if r["variant"] == "stock-flex" else r for r in rows]
    # the stock side is the variant [report.packing] names, whatever its name
    assert packing_vs_stock_points(renamed, SPEC) == []
    (p,) = packing_vs_stock_points(renamed, {**SPEC, "stock": "stock-flex-v2"})
    assert p["ratio"] == pytest.approx(1.25)
