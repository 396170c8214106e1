"""The packing sections: m, builds per step, the cache's saving against (L−1)·m, packed against stock."""

from __future__ import annotations

import pytest

from _report import spec

from harness.report import bench

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
    from harness.report.packing import packing_cache_md

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
    md = packing_cache_md(rows, m, SPEC)
    # 16 ms saved of a 16.5 ms device part; 2048: 130 ms of 137.5 ms predicted from the whole m
    assert "- GPU-bound: measured / device part median 0.97, range 0.97–0.97, 1 pairs." in md
    assert "1 more GPU-bound pairs predict a device part within their steps' p20–p80 band" in md
    assert "- Host-bound: measured / predicted (the whole m) median 0.95, range 0.95–0.95, 1 pairs." in md


def test_packing_cache_md_names_lengths_without_m():
    from harness.report.packing import packing_cache_md

    rows = [_packing_row("packed-flex", 400.0, seq_len=16384), _packing_row("packed-flex-nocache", 410.0, seq_len=16384)]
    md = packing_cache_md(rows, [], SPEC)
    assert "device part of it ms" in md and "The bench has no m for 16384 tokens on g" in md


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
    md = packing_cache_md(rows, [], SPEC)
    assert "| g | qwen3-0.6b | 8192 | flex | " in md and "| g | qwen3-0.6b | 8192 | flex (compiled) | " in md


def test_packing_best_packed_vs_stock_flex_met():
    from harness.report.packing import packing_targets_md, packing_vs_stock_points

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
    assert (at_2048["stock_ms"], at_2048["best_ms"], at_2048["ratio"]) == (300.0, None, None)
    # the one rendered check: the target's row, its verdict from the experiment file's min_ratio
    md = packing_targets_md(rows, [], SPEC)
    assert (f"| best packed path ≥ {SPEC['speedup']['min_ratio']:g}× faster than stock-flex, qwen3-0.6b at 8192 tokens "
            "(REFERENCE: stock 411 ms on the H100) | 2.50× (stock-flex 500.0 → packed-varlen-compiled 200.0 ms); "
            "over stock-flex-compiled 1.25× | met |") in md
    assert "10 minutes apart running the same code, so they likely come from one run." in md


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


def test_packing_best_packed_vs_stock_flex_not_met_and_different_runs():
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("stock-flex", 500.0, at="2026-11-21T20:00:00+00:00"),
            _packing_row("packed-flex", 450.0, at="2026-11-22T00:00:00+00:00")]
    md = packing_targets_md(rows, [], SPEC)
    assert "| 1.11× (stock-flex 500.0 → packed-flex 450.0 ms); over stock-flex-compiled – | not met |" in md
    assert "they are 240 minutes apart, so they come from different runs." in md
    # within 30 minutes but at another commit: still different runs
    rows[1].update(recorded_at="2026-11-21T20:05:00+00:00", env={"git_sha": "bbbb2222"})
    assert "ran different code (commits or code hashes differ), so they come from different runs." \
        in packing_targets_md(rows, [], SPEC)
    # different commits but one hash of the measuring code (a commit that added only results): one run
    rows[0]["env"] = {"git_sha": "aaaa1111", "code_sha": "c0de"}
    rows[1]["env"] = {"git_sha": "bbbb2222", "code_sha": "c0de"}
    assert "5 minutes apart running the same code, so they likely come from one run." in packing_targets_md(rows, [], SPEC)


def test_packing_targets_missing_stock_flex_and_odd_rows():
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-varlen", 380.0, peak=15.0),
            {"kind": "step"}, {"kind": "step", "variant": "stock-flex", "status": "ok", "step_ms": "fast"},
            {"kind": "step", "variant": "packed-sdpa", "model": "qwen3-0.6b", "seq_len": "8192", "status": "ok",
             "switches": None, "recorded_at": None, "peak_allocated_gib": float("nan")}]
    md = packing_targets_md(rows, [], SPEC)
    assert "None" not in md and "nan" not in md
    assert "qwen3-0.6b at 8192 tokens (REFERENCE: stock 411 ms on the H100) | not measured | – |" in md
    assert "#### Best packed path vs stock flex_attention" not in md
    assert "| g | qwen3-0.6b | 8192 | – | – | 15.000 | – / – | 0.062 | yes |" in md
    # a stock-flex row but no packed path at all: stated, not judged
    md = packing_targets_md([_packing_row("stock-flex", 500.0)], [], SPEC)
    assert "| stock-flex 500.0 ms, no packed row | – |" in md
    # and nothing at all still renders the target lines
    assert "not measured" in packing_targets_md([], [], SPEC)
    assert bench.sweep_targets({"packing": SPEC}, [{"kind": "step"}]) != []


def test_packing_cache_gain_vs_seeds():
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-flex-nocache", 500.0),  # +25%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 420.0),  # +5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b"),
            _packing_row("packed-sdpa-nocache", 303.0, model="llama-3.2-1b")]  # +1%
    md = packing_targets_md(rows, [], SPEC)
    assert ("| cache on saves ≥ the published +14.8% per step (qwen3-0.6b) | best +25.0% (flex, 8192 tokens; "
            "spread ±0%) | met |") in md
    assert ("| cache on saves ≥ the published +11.5% per step (llama-3.2-1b) | best +1.0% (sdpa, 8192 tokens; spread ±0%) | "
            "not met: see the measured / predicted column; the saving is (builds_off − builds_on)·m |") in md
    assert "| cache on saves ≥ the published +14.3% per step (qwen3-14b) | not measured | – |" in md


def test_packing_cache_gain_within_noise_is_not_judged():
    """Host-bound rows: a gain smaller than the rows' own p80/p20 spread measures nothing; the
    largest gain that clears its spread is the one judged."""
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0, spread=1.4), _packing_row("packed-flex-nocache", 500.0),  # +25% < 40%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 440.0, spread=1.05),  # +10% > 5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b", spread=1.3),
            _packing_row("packed-sdpa-nocache", 330.0, model="llama-3.2-1b")]  # +10% < 30%
    md = packing_targets_md(rows, [], SPEC)
    assert "(qwen3-0.6b) | best +10.0% (varlen, 8192 tokens; spread ±5%) | not met" in md
    assert "(llama-3.2-1b) | best +10.0% (sdpa, 8192 tokens; spread ±30%) | within noise" in md


def test_packing_peak_memory_side_by_side():
    from harness.report.packing import packing_targets_md

    rows = [_packing_row("packed-sdpa", 410.0, peak=15.8), _packing_row("packed-flex", 400.0, peak=15.7),
            _packing_row("packed-varlen", 390.0, peak=15.75, at="2026-11-22T02:00:00+00:00"),
            _packing_row("packed-flex-compiled", 200.0, peak=1.0)]  # compiled: not in this table
    md = packing_targets_md(rows, [], SPEC)
    assert "`tests/test_gpu_packing.py` (a GPU test) asserts it" in md
    assert "| g | qwen3-0.6b | 8192 | 15.800 | 15.700 | 15.750 | +0.100 / +0.050 | 0.062 | no |" in md


def test_packing_vs_stock_keeps_a_point_whose_stock_run_failed():
    from harness.report.packing import packing_targets_md

    failed = _packing_row("stock-flex", None, seq_len=16384, status="error")
    failed["message"] = "timed out after 150 s"
    md = packing_targets_md([failed, _packing_row("packed-flex", 700.0, seq_len=16384)], [], SPEC)
    assert "| g | qwen3-0.6b | 16384 | error: timed out after 150 s | 700.0 (packed-flex) | – |" in md

