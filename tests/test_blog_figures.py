"""The blog's figures and TL;DR ranges: every role a point measured is drawn, predictions against
measurements coloured by what varies, cross-run points marked, and ranges from one run's pairs."""

from __future__ import annotations

from harness.report.blog import data

def test_predicted_vs_measured_draws_a_gain_within_the_noise_hollow(tmp_path, monkeypatch):
    from harness.report.blog import figures

    drawn = {}
    monkeypatch.setattr(figures, "save_png", lambda fig, path: drawn.setdefault("fig", fig) and path)
    figures.predicted_vs_measured([("H100", 50.0, 40.0, False, "flex"), ("H100", 57.0, -103.0, True, "sdpa"),
                                   ("H200", 60.0, 55.0, False, "flex"), ("H200", None, 3.0, True, "flex")],
                                  tmp_path / "s.png", "saving (ms)")
    ax = drawn["fig"].axes[0]
    drawn_points = {tuple(c.get_offsets().tolist()[0]): c for c in ax.collections if len(c.get_offsets())}
    assert set(drawn_points) == {(50.0, 40.0), (57.0, -103.0), (60.0, 55.0)}  # no prediction: not drawn
    assert drawn_points[(57.0, -103.0)].get_facecolors().size == 0  # within the noise: hollow
    assert drawn_points[(50.0, 40.0)].get_facecolors().size
    # a colour per backend (flex twice alike, sdpa another), a marker per GPU
    flex, sdpa = drawn_points[(50.0, 40.0)].get_edgecolors()[0], drawn_points[(57.0, -103.0)].get_edgecolors()[0]
    assert list(flex) == list(drawn_points[(60.0, 55.0)].get_edgecolors()[0]) and list(flex) != list(sdpa)
    (legend,) = drawn["fig"].legends
    assert [t.get_text() for t in legend.get_texts()] == ["y = x (the model holds)", "H100", "H200", "flex", "sdpa"]
    # a length is a colour scale, not a legend entry per length
    drawn.clear()
    figures.predicted_vs_measured([("H100", 5.0, 6.0, False, "2048"), ("H100", 6.0, 5.0, False, "16384")],
                                  tmp_path / "t.png", "saving (ms)")
    assert [t.get_text() for t in drawn["fig"].legends[0].get_texts()] == ["y = x (the model holds)", "H100"]
    assert len(drawn["fig"].axes) == 2  # the plot and its colour bar


def test_the_speedup_figure_draws_every_role_a_point_measured_a_panel_per_model_and_gpu(tmp_path, monkeypatch):
    from harness.report.blog import figures

    seen = []
    monkeypatch.setattr(figures, "save_png", lambda fig, path: seen.append(fig) or path)

    def row(p50, when):
        return {"status": "ok", "step_ms": {"p20": p50, "p50": p50, "p80": p50},
                "recorded_at": f"2026-01-01T{when}:00+00:00", "env": {"code_sha": "c"}}

    pts = []
    for gpu in ("NVIDIA H100", "NVIDIA H200"):
        for t in (2048, 8192):
            pts.append(data.RolePoint(gpu, gpu, "m", t, rows={
                "stock": row(800.0, "10:00"), "stock-compiled": row(400.0, "02:00"),  # another run: hollow
                "peer": row(700.0, "10:01"), "user": row(300.0, "10:02"), "best": row(250.0, "10:03")}))
    assert figures.speedup_vs_length(pts, tmp_path / "x.png", "step time") == tmp_path / "x.png"
    (fig,) = seen
    assert [ax.get_title() for ax in fig.axes] == ["m, H100", "m, H200"]
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["stock = 1", "stock + torch.compile", "Liger-Kernel", "optim.enable() defaults",
                      "ours, best setting", "from another run than its stock"]


def test_predicted_vs_measured_crosses_a_pair_two_runs_measured(tmp_path, monkeypatch):
    from harness.report.blog import figures

    drawn = {}
    monkeypatch.setattr(figures, "save_png", lambda fig, path: drawn.setdefault("fig", fig) and path)
    figures.predicted_vs_measured([("H100", 50.0, 40.0, False, "flex", False), ("H100", 30.0, 20.0, False, "flex", True)],
                                  tmp_path / "s.png", "saving (ms)")
    offsets = [c.get_offsets().tolist() for c in drawn["fig"].axes[0].collections if len(c.get_offsets())]
    assert [[30.0, 20.0]] in offsets and sorted(map(tuple, offsets[0])) == [(30.0, 20.0), (50.0, 40.0)]


def test_the_tldr_gives_the_range_over_every_length_from_pairs_one_run_measured():
    from harness.report.blog.common import gains_range

    pairs = [{"gain_pct": 39.1, "noise_pct": 5.0, "seq_len": 2048, "one_run": True},
             {"gain_pct": 2.0, "noise_pct": 3.0, "seq_len": 8192, "one_run": True},
             {"gain_pct": -0.4, "noise_pct": 1.0, "seq_len": 16384, "one_run": None},  # no recording time: kept
             {"gain_pct": 38.8, "noise_pct": 1.0, "seq_len": 8192, "one_run": False}]  # two commits apart
    text = gains_range(pairs, "per step")
    assert text.startswith("-0.4 % to +39.1 % per step (median +2.0 %) over 3 model × length pairs, 2048–16384 tokens")
    assert "2 of them within the step's own spread" in text and "1 pairs measured by two runs left out" in text
    assert "38.8" not in text
    assert gains_range(pairs[3:], "per step") == "not measured in one run (1 pairs by two runs)"


def test_a_loss_past_the_spread_is_not_within_it_and_a_regression_is_not_noise():
    from harness.report.blog.common import gains_range

    text = gains_range([{"gain_pct": -10.0, "noise_pct": 5.0, "seq_len": 2048, "one_run": True},
                        {"gain_pct": 3.0, "noise_pct": 5.0, "seq_len": 8192, "one_run": True}], "per step")
    assert "1 of them within the step's own spread" in text  # the +3 %, not the -10 %


def _rp(gpu, t, **ms_when):
    def row(p50, when):
        return {"status": "ok", "step_ms": {"p20": p50, "p50": p50, "p80": p50}, "experiment": "x", "gpu_slug": gpu,
                "point_id": f"p{t}{p50}", "recorded_at": f"2026-01-01T{when}:00+00:00", "env": {"code_sha": "c"}}
    return data.RolePoint(gpu, f"NVIDIA {gpu}", "m", t, rows={k: row(*v) for k, v in ms_when.items()})


def test_the_headline_range_reads_pairs_one_run_measured_and_names_the_others_where_a_peer_wins():
    from harness.report import cite, headline

    pts = [_rp("H100", 2048, stock=(800.0, "10:00"), peer=(600.0, "10:01"), user=(300.0, "10:02")),
           _rp("H100", 8192, stock=(900.0, "10:00"), peer=(700.0, "10:01"), user=(500.0, "10:02")),
           # the compiled stock from a run days earlier, faster than the one call: counted apart, named
           _rp("H200", 2048, stock=(800.0, "10:00"), **{"stock-compiled": (150.0, "02:00")}, user=(200.0, "10:02"))]
    f = cite.Figures()
    text = headline._range(f, "packing", pts)
    # beside stock and Liger-Kernel alone: the range says not every peer ran, and names the missing
    assert ("Over the 2 points one run measured, not every peer ran (Unsloth, stock + torch.compile missing at some)"
            in text and "from 1.40× at m 8192" in text and "to 2.00× at m 2048" in text), text
    assert "At 1 more point the fastest other was measured by another run" in text
    assert "slower than it at 0.75× at m 2048 on the H200 (against stock + torch.compile, 2 of 4 peers run)" in text
    assert [shown for shown, _ in f.keys] == ["1.40×", "2.00×", "0.75×"]
    # one such point, the call faster than it: said in the singular
    pts[2] = _rp("H200", 2048, stock=(800.0, "10:00"), **{"stock-compiled": (450.0, "02:00")}, user=(200.0, "10:02"))
    text = headline._range(cite.Figures(), "packing", pts)
    assert text.endswith("At 1 more point the fastest other was measured by another run than the one call, "
                         "not faster than it."), text


def test_predicted_vs_measured_on_a_third_gpu_type_still_draws(tmp_path, monkeypatch):
    from harness.report.blog import figures

    drawn = {}
    monkeypatch.setattr(figures, "save_png", lambda fig, path: drawn.setdefault("fig", fig) and path)
    pairs = [(gpu, 10.0 + i, 9.0 + i, False, backend) for i, (gpu, backend) in
             enumerate((g, b) for g in ("H100", "H200", "B200") for b in ("sdpa", "flex", "varlen"))]
    assert figures.predicted_vs_measured(pairs, tmp_path / "s.png", "saving (ms)") == tmp_path / "s.png"
    labels = [t.get_text() for t in drawn["fig"].legends[0].get_texts()]
    assert labels == ["y = x (the model holds)", "flex", "sdpa", "varlen"]
    assert "B200" in drawn["fig"].axes[0].get_title()
