"""reports/README.md (``harness.report.blog``) and the plan that reproduces it: the plan's errors,
the roles read from rows, the figures' conventions, the report built from the committed results,
and the resumable runner on a machine without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from harness.report import fmt
from harness.report.blog import build_blog, data, plan, style
from harness.run import experiment, sweep
from harness.run.experiment import ExperimentError
from harness import reproduce

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "experiments" / "blog.toml"


def test_the_shipped_plan_parses_and_its_steps_name_real_files():
    p = plan.load(PLAN)
    assert set(p.sources) == {"user", "packing", "offload", "moe", "context", "scaling", "convergence"}
    for step in p.steps:
        if step.sweep or step.context:
            assert experiment.load(ROOT / "experiments" / (step.sweep or step.context)).points()
        else:
            assert (ROOT / "harness" / "bench" / f"{step.bench}.py").is_file()
    # the report's long-context searches, each estimated at no more than its file's probe time limit;
    # gpt-oss-20b's fits a call of the default --minutes (9), beside the command's start
    ctx = {s.context: s for s in p.steps if s.context}
    assert set(ctx) == {"context.toml", "context-moe.toml"}
    for name, step in ctx.items():
        assert step.estimate_s <= experiment.load(ROOT / "experiments" / name).timeout_s
    assert ctx["context-moe.toml"].estimate_s + reproduce._START_S <= 9 * 60
    # what does not fit in 80 GB runs on the H200 only
    assert {s.name for s in p.steps if s.min_gpu_gib > 80} >= {"user-moe qwen3-30b-a3b", "offload bench qwen3-32b 2048"}
    # the full ablation sweeps come last, after every step the report's figures read
    flags = [s.appendix for s in p.steps]
    assert any(flags) and flags == sorted(flags)
    # the steps that set stock, Liger-Kernel and enable() side by side hold them to one run
    assert {s.name for s in p.steps if s.together} == {
        "user.toml", "user-moe gpt-oss-20b", "user-moe qwen3-30b-a3b", "packing roles",
        "moe roles gpt-oss-20b", "moe roles qwen3-30b-a3b"}


@pytest.mark.parametrize("text, key", [
    ("[experiment]\nname = 'x'\n", r"\[blog\] missing"),
    ("[blog]\nsources = { speed = 'x' }\n", r"\[blog.sources.speed\] is not a section"),
    ("[blog]\nsources = { moe = 3 }\n", r"\[blog.sources.moe\] must be"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nsweep = 'moe.toml'\nbench = 'moe'\n", r"needs exactly one"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nsweep = 'nowhere.toml'\n", r"is not a file"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nbench = 'moe'\n", r"experiment\] missing"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nbench = 'moe'\nexperiment = 'moe'\n"
     "[[blog.steps]]\nbench = 'moe'\nexperiment = 'moe'\n", r"names two steps"),
    ("[blog\n", r"cannot be read"),
    ("[blog]\nsources = { moe = 'moe' }\n[blog.gate]\nab = ['x']\n", r"\[blog.gate\] unknown keys \['ab'\]"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nbench = 'moe'\nexperiment = 'moe'\nappendix = 'yes'\n",
     r"appendix\] must be"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nbench = 'moe'\nexperiment = 'moe'\ntogether = 'yes'\n",
     r"together\] must be"),
    ("[blog]\nsources = { moe = 'moe' }\n[[blog.steps]]\nbench = 'moe'\nexperiment = 'moe'\ntogether = true\n",
     r"together\] applies to a sweep step only"),
])
def test_a_malformed_plan_gets_one_error_naming_its_key(write_toml, text, key):
    with pytest.raises(ExperimentError, match=key):
        plan.load(write_toml(text, "plan.toml"))


def _row(variant, ms, *, role="ours", stack="", baseline="stock", status="ok", gpu="h", model="m", t=1024):
    return {"kind": "step", "status": status, "variant": variant, "role": role, "stack": stack,
            "baseline_variant": baseline, "gpu_slug": gpu, "device_name": "NVIDIA H100 80GB HBM3",
            "model": model, "seq_len": t, "gpus": 1, "recorded_at": "2026-11-23T00:00:00+00:00",
            "step_ms": {"p20": ms, "p50": ms, "p80": ms}}


def test_roles_come_from_what_rows_record_not_from_variant_names():
    rows = [_row("stock", 100, role="stock"), _row("stock-graph", 60, role="stock"),  # not the baseline
            _row("liger", 90, role="peer", stack="liger"), _row("user", 50, role="ours-default", stack="user"),
            _row("fast", 40), _row("fast", 44), _row("fast", 80), _row("broken", 1, status="oom"),
            _row("abl", 10, role="ablation")]
    (p,) = data.role_points(rows)
    assert p.ms("stock") == 100  # the experiment's baseline, not the faster graphed stock
    assert p.ms("peer") == 90 and p.ms("user") == 50
    assert p.ms("best") == 44 and p.rows["best"]["variant"] == "fast"  # the median repeat; ablations excluded
    assert p.speedup("best") == pytest.approx(100 / 44) and p.gpu_name == "H100"
    (q,) = data.role_points([_row("stock", 100, role="stock"), _row("user", 1, role="ours-default", stack="user",
                                                                   status="oom")])
    assert q.failed == {"user": "oom", "best": "oom"} and q.speedup("best") is None


def _at(row, when, code):
    row.update(recorded_at=f"2026-11-23T{when}:00+00:00", env={"code_sha": code})
    return row


def test_a_point_reads_its_roles_from_the_newest_run_that_measured_them_side_by_side():
    old = [_at(_row("stock", 90, role="stock"), "08:00", "old"),  # faster stock, earlier and other code
           _at(_row("stock", 80, role="stock"), "08:01", "old"),
           _at(_row("graph", 30), "08:05", "old")]
    new = [_at(_row("stock", 100, role="stock"), "11:00", "new"),
           _at(_row("liger", 95, role="peer", stack="liger"), "11:03", "new"),
           _at(_row("user", 50, role="ours-default", stack="user"), "11:06", "new")]
    (p,) = data.role_points(old + new)
    assert (p.ms("stock"), p.ms("peer"), p.ms("user")) == (100, 95, 50)  # one run, not the fastest repeat
    assert p.ms("best") == 30 and p.one_run() is False  # that run ran no setting beyond the defaults
    new.append(_at(_row("graph", 40), "11:09", "new"))
    (q,) = data.role_points(old + new)
    assert q.ms("best") == 40 and q.one_run() is True
    # no run holds all three: each role's variant takes its median repeat over every run, as before
    (r,) = data.role_points(old + new[:1] + new[2:])
    assert r.ms("stock") == 90 and r.one_run() is False  # the median of 80, 90 and 100


def _run(ms, experiment, sha, **kw):
    r = _row(kw.pop("variant", "user"), ms, role="ours-default", stack="user", **kw)
    r.update(experiment=experiment, env={"git_sha": sha * 8, "code_sha": sha}, batch_size=1,
             switches={"attn_implementation": "flex_attention"}, data={"median_doc_len": 1024})
    return r


def test_one_configuration_two_runs_measured_apart_is_listed_with_both():
    from harness.report.blog import consistency

    rows = [_run(236.5, "user-moe", "a"), _run(299.0, "moe", "b"),  # the same thing, 26 % apart
            _run(100.0, "user-moe", "a", model="n"), _run(104.0, "moe", "b", model="n"),  # inside 10 %
            _run(50.0, "user-moe", "a", model="o"), _run(80.0, "moe", "a", model="o", variant="x")]
    rows[-1]["switches"] = {"attn_implementation": "sdpa"}  # another configuration: not compared
    (d,) = data.disagreements(rows)
    assert (d.model, d.stack, d.gpu) == ("m", "user", "H100") and d.ratio == pytest.approx(299.0 / 236.5)
    assert [(exp, sha) for exp, sha, _, _ in d.runs] == [("user-moe", "aaaaaaaa"), ("moe", "bbbbbbbb")]
    assert [fmt.stat(r, "step_ms") for _, _, _, r in d.runs] == [236.5, 299.0]  # fastest first
    # the three places that list it say so (their wording is the committed report's snapshot)
    assert all((consistency.section([d]), consistency.tldr_note([d]), consistency.targets_note([d])))
    # one run's repeats of one point are not two runs
    assert data.disagreements([_run(236.5, "moe", "b"), _run(299.0, "moe", "b")]) == []
    assert consistency.section([]) == consistency.tldr_note([]) == consistency.targets_note([]) == ""


def test_a_figure_with_more_lines_than_a_reader_follows_is_refused():
    fig = Figure()
    ax = fig.subplots()
    for i in range(style.MAX_LINES + 2):
        ax.plot([0, 1], [i, i], label=f"line {i}")
    with pytest.raises(ValueError, match="at most 5 lines"):
        style.legend_outside(fig, [ax])


def test_the_report_from_the_committed_results(tmp_path):
    out = tmp_path / "reports"
    readme = build_blog(ROOT / "results", out, PLAN)
    text = readme.read_text()
    for heading in ("## TL;DR", "## The one call", "## 1. Packed-sequence metadata", "## 2. Double-buffered",
                    "## 3. MoE", "## Hardware", "## Targets: met or not", "## Methodology"):
        assert heading in text, heading
    # the analytic checks are worked through with numbers
    assert "(builds off − builds on)·m" in text and "(n−1)·min(c,g)" in text and "s* tokens" in text
    # every figure linked exists, and none is left unlinked
    linked = set(re.findall(r"\]\((figures/[^)]+\.png)\)", text))
    assert linked and linked == {f"figures/{p.name}" for p in (out / "figures").glob("*.png")}
    # every target is judged or says it was not measured
    targets = text.split("## Targets: met or not")[1].split("## Methodology")[0]
    assert "not measured" in targets  # multi-gpu has no rows yet
    assert "met" in targets and "| target |" in targets
    # the gate's own targets, judged from its committed runs
    assert "### `gate`" in targets and "the suite finishes in ≤ 8 minutes" in targets
    # the commands a reader reruns name no path of the machine that wrote the rows
    method = text.split("## Methodology")[1]
    assert "--results" not in method and "--stop-after" not in method and "python -m harness sweep" in method
    # rebuilt from the same rows, the same markdown
    assert build_blog(ROOT / "results", out, PLAN).read_text() == text


@pytest.mark.parametrize("recorded, shown", [
    ("python -m harness sweep experiments/moe.toml --no-report --quiet --stop-after 470 --models gpt-oss-20b "
     "--results /work/x/results --overwrite", "python -m harness sweep experiments/moe.toml --models gpt-oss-20b"),
    ("python -m harness.bench.moe --results=/tmp/r --experiment moe", "python -m harness.bench.moe --experiment moe"),
    ("python -m harness sweep experiments/moe.toml --no-report --models gpt-oss-20b --results /r --deadline 480 "
     "--point-estimate 300", "python -m harness sweep experiments/moe.toml --models gpt-oss-20b"),
    ("python -m harness sweep 'experiments/a b.toml' --launcher preloaded",
     "python -m harness sweep 'experiments/a b.toml' --launcher preloaded"),
    ("python -m harness sweep 'unbalanced", "python -m harness sweep 'unbalanced"),
])
def test_a_recorded_command_is_shown_as_a_reader_reruns_it(recorded, shown):
    assert fmt.command(recorded) == shown


def test_the_gate_targets_are_judged_from_its_runs(tmp_path):
    import json

    from harness.report.blog import gate

    def run(name, outcome, points, guards=(), rounds=((100.0,),), parity_s=30.0):
        (tmp_path / name).mkdir()
        (tmp_path / name / "gate.json").write_text(json.dumps({
            "outcome": outcome, "points": points, "guards": list(guards), "parity_s": parity_s,
            "rounds": [{"wall_s": w} for (w,) in rounds]}))

    def pt(low, high, verdict="PASS"):
        return {"label": "p", "time": {"estimate": (low + high) / 2, "low": low, "high": high}, "verdict": verdict}

    run("aa", "pass", [pt(0.9, 1.1), pt(0.99, 1.01)], rounds=((200.0,), (250.0,)))
    run("aa-off", "pass", [pt(1.01, 1.2)])  # passes, yet an interval misses 1.0: not met
    run("cache", "fail", [pt(0.9, 1.1)], guards=[{"guard": {"switch": "packing_cache"}, "ok": False}])
    run("other", "fail", [pt(0.9, 1.1)], guards=[{"guard": {"switch": "moe_lora"}, "ok": False}])
    run("mem", "fail", [pt(0.9, 1.1, "MEMORY")])
    with fmt.recording() as tables:
        gate.targets(tmp_path, {"a_a": ["aa", "aa-off", "gone"], "max_minutes": 8,
                                "must_fail": {"cache": "packing_cache", "other": "packing_cache", "mem": "memory"},
                                "must_pass": ["aa"]})
    rows = {r["target"]: (r["measured"], r["met?"]) for r in tables.find("met?").rows()}
    assert rows["A/A: head against itself passes, every interval holding 1.0 (`aa`)"][1] is True
    assert rows["A/A: head against itself passes, every interval holding 1.0 (`aa-off`)"][1] is False
    assert rows["A/A: head against itself passes, every interval holding 1.0 (`gone`)"] == ("not measured", None)
    assert rows["a planted packing_cache regression fails and names it (`cache`)"][1] is True
    assert rows["a planted packing_cache regression fails and names it (`other`)"][1] is False  # wrong switch
    assert rows["a planted memory regression fails and names it (`mem`)"][1] is True
    assert rows["a slowdown below the threshold passes (`aa`)"][1] is True
    # the newest A/A run's rounds and parity: (100 + 30) / 60 = 2.2 minutes for aa-off
    minutes = rows["the suite finishes in ≤ 8 minutes on one GPU, rounds and parity included"]
    assert minutes == (pytest.approx(130 / 60), True)
    assert gate.targets(tmp_path, {}) == ""

    # max_half_width: aa's widest interval is +-10 %, so it holds 1.0 yet does not resolve 5 %;
    # a planted step-time regression is met when some point is named SLOWER
    run("slow", "fail", [pt(1.2, 1.3, "SLOWER"), pt(0.99, 1.01)])
    run("quiet", "fail", [pt(0.99, 1.01)], guards=[{"guard": {"switch": "moe_lora"}, "ok": False}])
    with fmt.recording() as tables:
        gate.targets(tmp_path, {"a_a": ["aa"], "max_half_width": 0.05, "must_fail": {"slow": "time", "quiet": "time"}})
    rows = {r["target"]: (r["measured"], r["met?"]) for r in tables.find("met?").rows()}
    measured, met = rows["A/A: head against itself passes, every interval holding 1.0 within ±5% (`aa`)"]
    assert met is False and measured.endswith("widest ±10.0%")
    with fmt.recording() as tables:
        gate.targets(tmp_path, {"a_a": ["aa"], "max_half_width": 0.11})
    assert [r["met?"] for r in tables.find("met?").rows()] == [True]
    assert rows["a planted time regression fails and names it (`slow`)"] == ("fail; SLOWER on p", True)
    assert rows["a planted time regression fails and names it (`quiet`)"][1] is False  # failed, not on time


def test_a_plan_whose_experiments_have_no_rows_still_writes_a_report(tmp_path, write_toml):
    p = write_toml("[blog]\nsources = { moe = 'nothing-here' }\n", "plan.toml")
    readme = build_blog(tmp_path / "results", tmp_path / "reports", p)
    assert "## TL;DR" in readme.read_text() and "not measured" in readme.read_text()


def test_reproduce_on_a_machine_without_a_gpu_refuses_and_dry_runs(tmp_path, capsys):
    assert reproduce.run(PLAN, results=tmp_path) == 2
    assert "need a CUDA GPU" in capsys.readouterr().err
    assert reproduce.run(PLAN, results=tmp_path, dry_run=True) == 0
    err = capsys.readouterr().err
    assert "run user.toml" in err and "--deadline" in err and "skip offload bench qwen3-32b 8192" in err


def test_reproduce_runs_only_the_named_steps_and_names_the_plans_steps_when_one_is_unknown(tmp_path, capsys):
    assert reproduce.run(PLAN, results=tmp_path, dry_run=True, steps=["moe", "packing cache pairs"]) == 0
    err = capsys.readouterr().err
    ran = [ln.split(":")[0] for ln in err.splitlines() if ln.startswith("run ")]
    assert ran == ["run packing cache pairs", "run moe"], err  # the plan's order, not the arguments'
    with pytest.raises(ExperimentError, match=r"no step named 'packing cash pairs'.*'packing cache pairs'"):
        reproduce.run(PLAN, results=tmp_path, dry_run=True, steps=["packing cash pairs"])
    from harness import cli

    assert cli.main(["reproduce", str(PLAN), "--dry-run", "--step", "nope"]) == 2
    assert "no step named 'nope'" in capsys.readouterr().err


def _tiny_experiment(tmp_path, variants: str = "[variants.a]\nattn_implementation = 'sdpa'\n"
                                                 "[variants.b]\nattn_implementation = 'eager'\n") -> Path:
    """experiments file ``e`` beside the plan: a tiny Qwen3 at 64 and 128 tokens on the CPU."""
    path = tmp_path / "e.toml"
    path.write_text("[experiment]\nname = 'e'\nmodels = ['qwen3-0.6b-tiny']\nseq_lens = [64, 128]\ndevice = 'cpu'\n"
                    "dtype = 'fp32'\nbandwidth = false\n" + variants)
    return path


def test_status_says_what_is_left_on_a_gpu_type_from_the_rows_alone(tmp_path, write_toml, capsys):
    from harness import results as res
    from harness.measure.env import code_id

    _tiny_experiment(tmp_path)
    p = write_toml("[blog]\nsources = { moe = 'e' }\n"
                   "[[blog.steps]]\nname = 'cut'\nsweep = 'e.toml'\nargs = ['--variants', 'a']\n"
                   "[[blog.steps]]\nname = 'big'\nsweep = 'e.toml'\nmin_gpu_gib = 100\n"
                   "[[blog.steps]]\nname = 'all'\nsweep = 'e.toml'\nappendix = true\n", "plan.toml")
    assert reproduce.status(p, "gpu-x", 80, results=tmp_path / "r") == 3
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:] if ln.startswith("  ")}
    # nothing ran anywhere: each point is expected to take its step's estimate_s (300 s by default)
    assert lines["cut"].endswith("2 of 2 points left, ~10 min") and lines["all"].endswith("4 of 4 points left, ~20 min")
    assert "big" in out and "skipped: needs 100 GiB" in out
    assert "the report's figures: 2 of 2 points left, ~10 min of GPU time" in out
    assert "the appendix's tables: 4 of 4 points left, ~20 min of GPU time" in out
    # a finished row of other code (another code_id) leaves its point to run again, as the sweep does
    exp = experiment.subset(experiment.load(tmp_path / "e.toml"), variants=["a"])
    point = exp.points()[0]
    res.append_row(res.results_path(tmp_path / "r", "e", "gpu-x"), {"kind": "step", "status": "ok",
                   "point_id": point.point_id, "variant": "a", "env": {"code_id": "other"}})
    reproduce.status(p, "gpu-x", 80, results=tmp_path / "r")
    assert "the report's figures: 2 of 2 points left" in capsys.readouterr().out
    # one finished row of this code: one point left there, and three in the appendix
    res.append_row(res.results_path(tmp_path / "r", "e", "gpu-x"), {"kind": "step", "status": "ok",
                   "point_id": point.point_id, "variant": "a", "env": {"code_id": code_id()}})
    reproduce.status(p, "gpu-x", 80, results=tmp_path / "r")
    out = capsys.readouterr().out
    assert "the report's figures: 1 of 2 points left" in out and "the appendix's tables: 3 of 4 points left" in out
    # a point that ran on another GPU type in 50 s is expected to take 60 s here (+10 % + 5 s)
    other = exp.points()[1]
    res.append_row(res.results_path(tmp_path / "r", "e", "gpu-y"), {"kind": "step", "status": "ok",
                   "point_id": other.point_id, "variant": "a", "gpu_slug": "gpu-y", "wall_s": 50.0})
    reproduce.status(p, "gpu-x", 80, results=tmp_path / "r")
    out = capsys.readouterr().out
    assert "the report's figures: 1 of 2 points left, ~1 min of GPU time" in out, out
    # a GPU type with no rows, where another has some, is named as such (a misspelt slug)
    reproduce.status(p, "gpu", 80, results=tmp_path / "r")
    err = capsys.readouterr().err
    assert "no rows for gpu under" in err and err.rstrip().endswith("with rows: gpu-x, gpu-y")
    reproduce.status(p, "gpu-x", 80, results=tmp_path / "r")
    assert "no rows" not in capsys.readouterr().err
    # part of one GPU type's name, as a reader types it ("h100"), is that GPU type
    reproduce.status(p, "Y", 80, results=tmp_path / "r")
    out, err = capsys.readouterr()
    assert "no rows" not in err and "is gpu-y" in err and out.startswith("plan.toml on gpu-y"), (out, err)


def test_a_together_group_is_done_only_when_its_rows_come_from_one_run():
    from datetime import datetime, timezone
    from types import SimpleNamespace as P

    pts = [P(point_id=v, variant=v, model="m", seq_len=8192) for v in ("stock", "liger", "user")]
    now = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc).timestamp()

    def rows(*spec):  # (variant, minutes before now, code)
        return {v: {"point_id": v, "recorded_at": datetime.fromtimestamp(now - 60 * ago, timezone.utc).isoformat(),
                    "env": {"code_sha": code}} for v, ago, code in spec}

    todo = reproduce.group_todo
    assert todo(pts, {}, "c", now, 60) == (pts, False)  # nothing yet: run them all, nothing to overwrite
    assert todo(pts, rows(("stock", 50, "c"), ("liger", 45, "c"), ("user", 40, "c")), "c", now, 60) == ([], False)
    # stock ran minutes ago with this code: the other two join its run
    assert todo(pts, rows(("stock", 5, "c")), "c", now, 60) == (pts[1:], False)
    # ...but not when they could not finish within the half hour, or the code has changed since
    assert todo(pts, rows(("stock", 29, "c")), "c", now, 60) == (pts, True)  # 29 + 2 x 1 min > 30
    # unless the two ran here before in 20 s each: 29 min + 2 x (20 s + 10 % + 5 s) fits in 30
    assert todo(pts, rows(("stock", 29, "c")), "c", now, 60, {"liger": 20.0, "user": 20.0}) == (pts[1:], False)
    assert todo(pts, rows(("stock", 29, "c")), "c", now, 60, {"liger": 20.0}) == (pts, True)  # user: 60 s
    assert todo(pts, rows(("stock", 5, "old")), "c", now, 60) == (pts, True)
    # all three there, but stock from a day earlier: stock again, to join the other two's run
    assert todo(pts, rows(("stock", 1440, "c"), ("liger", 5, "c"), ("user", 4, "c")), "c", now, 60) == (pts[:1], True)
    # a re-run stopped after its first point: the next call finishes that run, not a new one
    assert todo(pts, rows(("stock", 3, "c"), ("liger", 1440, "old"), ("user", 1440, "old")), "c", now, 60) == \
        (pts[1:], True)
    # all three stale: all three again
    assert todo(pts, rows(("stock", 1440, "c"), ("liger", 1440, "old"), ("user", 1440, "old")), "c", now, 60) == \
        (pts, True)


def test_a_together_step_runs_each_group_cut_to_its_model_and_length(tmp_path, write_toml, capsys):
    from harness import results as res

    _tiny_experiment(tmp_path)
    p = write_toml("[blog]\nsources = { moe = 'e' }\n"
                   "[[blog.steps]]\nname = 'roles'\nsweep = 'e.toml'\ntogether = true\nestimate_s = 1\n", "plan.toml")
    step = plan.load(p).steps[0]
    pt = experiment.load(tmp_path / "e.toml").points()[0]  # T=64, variant a: a day old
    res.append_row(res.results_path(tmp_path / "r", "e", "cpu"),
                   {"kind": "step", "status": "ok", "point_id": pt.point_id, "variant": "a",
                    "recorded_at": "2026-01-01T00:00:00+00:00", "env": {"code_sha": "old"}})
    assert reproduce.points_left(step, tmp_path, tmp_path / "r", "cpu") == (4, 4)
    cmds = [argv for argv, _ in reproduce.work(step, tmp_path, tmp_path / "r", "cpu")]
    assert [c[c.index("--seq-lens") + 1] for c in cmds] == ["64", "128"]
    assert cmds[0][-4:] == ["--variants", "a", "b", "--overwrite"] and cmds[1][-3:] == ["--variants", "a", "b"]
    assert reproduce.run(p, results=tmp_path / "r", dry_run=True) == 0
    assert capsys.readouterr().err.count("run roles") == 2


def test_a_together_step_holds_only_stock_the_peer_and_enable_to_one_run(tmp_path, write_toml):
    from harness import results as res

    _tiny_experiment(tmp_path, "baseline = 'a'\n[variants.a]\nrole = 'stock'\n[variants.b]\nrole = 'ours'\n"
                     "attn_implementation = 'eager'\n[variants.u]\nrole = 'ours-default'\nstack = 'user'\n")
    p = write_toml("[blog]\nsources = { moe = 'e' }\n"
                   "[[blog.steps]]\nname = 'roles'\nsweep = 'e.toml'\ntogether = true\nestimate_s = 1\n", "plan.toml")
    step = plan.load(p).steps[0]
    path = res.results_path(tmp_path / "r", "e", "cpu")
    for pt in experiment.load(tmp_path / "e.toml").points():
        if pt.seq_len == 64:  # stock and enable() a day apart; ours' setting ran once, whenever
            when = {"a": "2026-01-01T00:00:00", "b": "2026-01-01T00:00:00", "u": "2026-01-02T00:00:00"}[pt.variant]
            res.append_row(path, {"kind": "step", "status": "ok", "point_id": pt.point_id, "variant": pt.variant,
                                  "recorded_at": when + "+00:00", "env": {"code_sha": "old"}})
    cmds = [c[c.index("--seq-lens") + 1:] for c, _ in reproduce.work(step, tmp_path, tmp_path / "r", "cpu")]
    assert cmds == [["64", "--variants", "a", "u", "--overwrite"],  # b keeps its row
                    ["128", "--variants", "a", "u"], ["128", "--variants", "b"]]


def test_a_bench_step_is_done_once_its_command_wrote_rows_for_all_it_names(tmp_path):
    from harness import results as res

    step = plan.Step(name="b", bench="moe", experiment="moe", args=("--model", "gpt-oss-20b"))
    assert reproduce.pending(step, PLAN.parent, tmp_path, "cpu")
    res.write_bench_rows(tmp_path, "moe", [{"kind": "moe_syncs", "model": "gpt-oss-20b", "tokens": 2048}], env={},
                         command="python -m harness.bench.moe --experiment moe --model gpt-oss-20b --results /x")
    assert not reproduce.pending(step, PLAN.parent, tmp_path, "cpu")
    # an offload bench killed after its first length wrote that length's rows only: not done;
    # a step asking for that length alone is
    cmd = "python -m harness.bench.offload --experiment offload --model qwen3-8b --seq-len 2048 --seq-len 8192"
    res.write_bench_rows(tmp_path, "offload", [{"kind": "offload_summary", "model": "qwen3-8b", "seq_len": 2048}],
                         env={}, command=cmd)
    both = plan.Step(name="o", bench="offload", experiment="offload",
                     args=("--model", "qwen3-8b", "--seq-len", "2048", "--seq-len", "8192"))
    assert reproduce.pending(both, PLAN.parent, tmp_path, "cpu")
    first = plan.Step(name="o1", bench="offload", experiment="offload", args=("--model", "qwen3-8b", "--seq-len", "2048"))
    second = plan.Step(name="o2", bench="offload", experiment="offload", args=("--model", "qwen3-8b", "--seq-len", "8192"))
    assert not reproduce.pending(first, PLAN.parent, tmp_path, "cpu") and reproduce.pending(second, PLAN.parent, tmp_path, "cpu")


def test_a_sweep_past_its_stop_after_starts_nothing_and_leaves_the_rest_to_a_rerun(tmp_path, write_toml):
    exp = experiment.load(write_toml(
        "[experiment]\nname = 's'\nmodels = ['qwen3-0.6b-tiny']\nseq_lens = [64, 128]\ndevice = 'cpu'\n"
        "dtype = 'fp32'\nbandwidth = false\n[variants.a]\nattn_implementation = 'sdpa'\n"))
    summary = sweep.run(exp, tmp_path / "results", progress=False, stop_after_s=-1)
    assert summary.ran == 0 and summary.left == 2


def test_a_sweep_with_a_deadline_starts_only_the_points_whose_estimate_fits(tmp_path, write_toml):
    from harness import results as res

    exp = experiment.load(write_toml(
        "[experiment]\nname = 's'\nmodels = ['qwen3-0.6b-tiny']\nseq_lens = [64, 128]\ndevice = 'cpu'\n"
        "dtype = 'fp32'\nbandwidth = false\n[variants.a]\nattn_implementation = 'sdpa'\n"))
    first, second = exp.points()
    # the first point failed last time after 1000 s: it would not end within the deadline; the
    # second has no history and no default estimate, so it starts (the deadline has not passed)
    path = res.results_path(tmp_path / "results", "s", "cpu")
    res.append_row(path, {"kind": "step", "status": "error", "point_id": first.point_id, "wall_s": 1000.0})
    summary = sweep.run(exp, tmp_path / "results", progress=False, deadline_s=600)
    assert summary.ran == 1 and summary.left == 1
    assert res.finished_point_ids(path) == {second.point_id}
    # a default estimate past the deadline holds back a point never run here
    assert sweep.run(exp, tmp_path / "results", progress=False, deadline_s=600, point_estimate_s=700).left == 1
    assert res.point_estimate_s({"x": 100.0}, "x", 5) == pytest.approx(115.0)
    assert res.point_estimate_s({}, "x", 5) == 5 and res.point_estimate_s({}, "x", None) is None



def test_a_point_timed_only_on_another_gpu_type_is_expected_to_take_half_as_long_again(tmp_path, write_toml):
    from harness import results as res

    exp = experiment.load(write_toml(
        "[experiment]\nname = 's'\nmodels = ['qwen3-0.6b-tiny']\nseq_lens = [64, 128]\ndevice = 'cpu'\n"
        "dtype = 'fp32'\nbandwidth = false\n[variants.a]\nattn_implementation = 'sdpa'\n"))
    first, second = exp.points()
    root = tmp_path / "results"
    # on another GPU type the first took 500 s (here: 755 s, capped at the default 700, past the
    # deadline), the second 100 s (here: 155 s, within it); neither has run on this one
    other = res.results_path(root, "s", "nvidia-h200")
    res.append_row(other, {"kind": "step", "status": "ok", "point_id": first.point_id, "wall_s": 500.0})
    res.append_row(other, {"kind": "step", "status": "ok", "point_id": second.point_id, "wall_s": 100.0})
    here, elsewhere = res.wall_history(root, "s", "cpu")
    assert here == {} and elsewhere == {first.point_id: 500.0, second.point_id: 100.0}
    assert res.point_estimate_s(here, first.point_id, 700, elsewhere) == 700
    assert res.point_estimate_s(here, second.point_id, 700, elsewhere) == pytest.approx(155.0)
    assert res.point_estimate_s(here, second.point_id, None, elsewhere) == pytest.approx(155.0)
    summary = sweep.run(exp, root, progress=False, deadline_s=600, point_estimate_s=700)
    assert summary.ran == 1 and summary.left == 1
    assert res.finished_point_ids(res.results_path(root, "s", "cpu")) == {second.point_id}
    # once it has run here, its own time counts, not the other GPU type's
    mine = res.read_rows(res.results_path(root, "s", "cpu"))[-1]["wall_s"]
    here, elsewhere = res.wall_history(root, "s", "cpu")
    assert res.point_estimate_s(here, second.point_id, 700, elsewhere) == pytest.approx(mine * 1.1 + 5)

def test_reproduce_estimates_a_point_by_its_own_earlier_wall_time(tmp_path, write_toml, capsys):
    from harness import results as res

    _tiny_experiment(tmp_path)
    # the step's estimate (1000 s) says nothing fits in a minute, but every point ran here in 2 s
    p = write_toml("[blog]\nsources = { moe = 'e' }\n"
                   "[[blog.steps]]\nname = 'cut'\nsweep = 'e.toml'\nestimate_s = 1000\n", "plan.toml")
    path = res.results_path(tmp_path / "r", "e", "cpu")
    pts = experiment.load(tmp_path / "e.toml").points()
    for pt in pts:
        res.append_row(path, {"kind": "step", "status": "error", "point_id": pt.point_id, "wall_s": 2.0})
    assert reproduce.run(p, minutes=1, results=tmp_path / "r", dry_run=True) == 0
    err = capsys.readouterr().err
    assert "run cut" in err and "--deadline 50 --point-estimate 1000" in err, err
    # and the other way: points that took 1000 s here are not started with a minute left
    for pt in pts:
        res.append_row(path, {"kind": "step", "status": "error", "point_id": pt.point_id, "wall_s": 1000.0})
    reproduce.run(p, minutes=1, results=tmp_path / "r", dry_run=True)
    assert "run cut" not in capsys.readouterr().err



def test_a_side_by_side_group_starts_only_when_all_of_it_fits_unless_no_call_could_hold_it():
    from types import SimpleNamespace as P

    step = plan.Step(name="roles", sweep="e.toml", estimate_s=300, together=True)
    stock = P(point_id="s", role="stock", variant="stock", baseline_variant="stock", stack="")
    peer = P(point_id="l", role="peer", variant="liger", baseline_variant="stock", stack="liger")
    user = P(point_id="u", role="ours-default", variant="user", baseline_variant="stock", stack="user")
    graph = P(point_id="g", role="ours", variant="graph", baseline_variant="stock", stack="")
    here = {"s": 45.0, "l": 250.0, "u": 45.0, "g": 50.0}  # estimates 54.5, 280, 54.5 and 60 s
    # stock, Liger and enable() count only from one run: all three must fit (389 s), not the shortest
    assert reproduce._needs(step, [stock, peer, user], here, {}, budget=552) == pytest.approx(389.0)
    # a group no call could hold (Liger at 600 s) starts when its shortest fits, and is joined by the next call
    assert reproduce._needs(step, [stock, peer, user], {**here, "l": 600.0}, {}, budget=552) == pytest.approx(54.5)
    # ours' other settings need a finished row each, not one run
    assert reproduce._needs(step, [graph, stock], here, {}, budget=552) == pytest.approx(54.5)
    assert reproduce._needs(step, [graph], here, {}, budget=552) == pytest.approx(60.0)
    apart = plan.Step(name="cut", sweep="e.toml", estimate_s=300)
    assert reproduce._needs(apart, [stock, peer, user], here, {}, budget=552) == pytest.approx(54.5)
    assert reproduce._needs(apart, [], here, {}, budget=552) == 300

def test_bandwidth_on_a_third_gpu_type_keeps_within_the_line_budget(tmp_path):
    from harness.report.blog import figures

    series = {(g, kind): [(2**20, 40.0), (2**30, 55.0)] for g in ("H100", "H200", "B200") for kind in ("pinned", "pageable")}
    path = figures.bandwidth(series, {"H100": 63.0, "H200": 63.0, "B200": 63.0}, tmp_path / "bw.png")
    assert path.is_file()  # pinned only: three lines and the ceiling
    with pytest.raises(ValueError):  # the budget is real: the same six lines drawn directly are refused
        fig = Figure()
        ax = fig.subplots()
        for (g, kind), pts in series.items():
            ax.plot(*zip(*pts), label=f"{g}, {kind}")
        ax.axhline(63.0, label="ceiling")
        style.legend_outside(fig, [ax])


def test_the_peers_table_claims_no_run_where_one_role_alone_was_measured():
    from harness.report.blog.common import peers_table

    def row(variant: str, p50: float, when: str) -> dict:
        return {"variant": variant, "status": "ok", "step_ms": {"p20": p50, "p50": p50, "p80": p50},
                "recorded_at": when, "env": {"code_sha": "c"}}

    alone = data.RolePoint("gpu-x", "NVIDIA H200", "m", 16384, rows={"best": row("packed-flex", 615.9, "2026-01-01T00:00:00+00:00")})
    pair = data.RolePoint("gpu-x", "NVIDIA H200", "m", 2048, rows={"stock": row("s", 400.0, "2026-01-01T00:00:00+00:00"),
                                                                "best": row("o", 200.0, "2026-01-01T00:05:00+00:00")})
    with fmt.recording() as tables:
        peers_table([alone, pair])
    assert [(r["best variant"], r["one run"]) for r in tables[0].rows()] == [("`packed-flex`", "–"), ("`o`", "yes")]



def test_a_cell_from_another_run_than_its_stock_carries_a_dagger_and_the_table_says_why():
    from harness.report.blog.common import peers_table

    def row(variant: str, p50: float, when: str, code: str = "c") -> dict:
        return {"variant": variant, "status": "ok", "step_ms": {"p20": p50, "p50": p50, "p80": p50},
                "recorded_at": f"2026-01-01T{when}:00+00:00", "env": {"code_sha": code}}

    # the peer came from a run hours earlier, enable() from the stock's own run, best from other code
    p = data.RolePoint("gpu-x", "NVIDIA H200", "m", 2048,
                       rows={"stock": row("s", 800.0, "10:00"), "peer": row("liger", 1200.0, "02:00"),
                             "user": row("user", 400.0, "10:03"), "best": row("o", 300.0, "10:06", code="d")})
    with fmt.recording() as tables:
        peers_table([p])
    (shown,) = tables[0].rows()
    cells = [shown[k] for k in tables[0].header if k.endswith(" ms")]
    assert cells == [(800.0, None, False), "not run", (1200.0, pytest.approx(800 / 1200), True), "not run", (400.0, 2.0, False),
                     (300.0, pytest.approx(800 / 300), True)], cells
    assert peers_table([p]).endswith("† measured by another run than the stock beside it: its ratio compares two runs.")
    p.rows["peer"] = row("liger", 1200.0, "10:01")
    p.rows["best"] = row("o", 300.0, "10:06")
    with fmt.recording() as tables:
        peers_table([p])
    assert not any(v[2] for k, v in tables[0].rows()[0].items() if k.endswith(" ms") and isinstance(v, tuple))

def test_a_role_the_plan_skips_on_a_smaller_gpu_says_so_where_one_merely_missing_says_not_run():
    from harness.report.blog import moe

    steps = [plan.Step("a", sweep="moe.toml", args=("--models", "big", "--variants", "x"), min_gpu_gib=100),
             plan.Step("b", bench="moe", experiment="moe", args=("--model", "big", "--model", "small")),
             plan.Step("c", sweep="moe.toml", min_gpu_gib=120)]  # every model of its file: names none
    assert [s.models() for s in steps] == [("big",), ("big", "small"), ()]
    assert plan.Plan(Path("p.toml"), "t", {}, steps=tuple(steps)).min_gib() == {"big": 100.0}

    def row(gpu, gib, model, variant, role, p50):
        return {**_row(variant, p50, role=role, gpu=gpu, model=model, t=2048),
                "device_name": f"NVIDIA {gpu}", "env": {"code_sha": "c", "memory_total_gib": gib}}

    rows = [row("H100", 79.6, "big", "o", "ours", 600.0), row("H200", 140.4, "big", "stock", "stock", 900.0),
            row("H200", 140.4, "big", "o", "ours", 300.0), row("H100", 79.6, "small", "stock", "stock", 500.0)]
    short = moe._too_small(rows, {"big": 100.0})
    assert short == {"big": {"H100": "skipped (GPU < 100 GiB)"}}
    lines = moe._seeds_table(data.role_points(rows), "big", {}, short["big"]).splitlines()
    h100, h200 = lines[4].split(" | ")[4:10], lines[4].split(" | ")[10:16]
    assert h100 == ["skipped (GPU < 100 GiB)"] * 5 + ["600.0"], lines  # the setting that fit is kept
    assert h200[0] == "900.0" and h200[1:5] == ["not run"] * 4, lines  # the big GPU's gap is just not run
    small = moe._seeds_table(data.role_points(rows), "small", {}, short.get("small")).splitlines()
    assert "skipped" not in "\n".join(small) and "not run" in small[4], small


def test_the_targets_keep_the_heading_that_names_their_gpu():
    from harness.report.blog.appendix import _target_tables

    md = ("### NVIDIA H100 (`h100`): ours vs stock\n\n| model | ms |\n|---|---|\n| m | 1 |\n\n"
          "#### End-to-end targets on NVIDIA H100\n\n| target | measured | met? |\n|---|---|---|\n| a | 1 | yes |\n\n"
          "#### End-to-end targets on NVIDIA H200\n\n| target | measured | met? |\n|---|---|---|\n| a | 2 | no |\n")
    one, two = _target_tables(md)  # the table of numbers stays behind
    assert one.startswith("**End-to-end targets on NVIDIA H100**\n\n| target |") and one.endswith("| a | 1 | yes |")
    assert two.startswith("**End-to-end targets on NVIDIA H200**\n\n") and two.endswith("| a | 2 | no |")
    assert _target_tables("| target | measured |\n|---|---|\n| b | 3 |") == ["| target | measured |\n|---|---|\n| b | 3 |"]


def test_the_blog_reads_offload_from_the_benches_alone_so_the_offload_sweep_is_appendix():
    """experiments/blog.toml runs offload.toml as an appendix step: the report's offload section
    must not read its rows, or the report's figures would wait on a step --status calls appendix."""
    from harness.report.blog import offload

    sweep_rows = [{"kind": "step", "experiment": "offload", "gpu_slug": "nvidia-h200", "device_name": "NVIDIA H200",
                   "model": "qwen3-8b", "seq_len": 2048, "variant": mode, "status": "ok",
                   "step_ms": {"p20": 900.0, "p50": 1000.0, "p80": 1100.0}} for mode in ("none", "single", "double")]
    md, head = offload.section(sweep_rows, {}, Path("/nonexistent"), Path("/nonexistent"))
    assert md == "" and head.measured == {}
    steps = {s.sweep: s for s in plan.load(PLAN).steps if s.sweep}
    assert steps["offload.toml"].appendix


def test_a_sweep_stopped_halfway_through_a_point_keeps_how_long_it_ran_and_nothing_reads_it_as_a_result(
        tmp_path, write_toml, monkeypatch):
    """`timeout` stopping reproduce mid-point left no trace: the next call expected the point to
    take its old 72 s and was stopped in it again. The stopped row tells it otherwise."""
    import time as _time

    from harness import results as res
    from harness.report import build_report
    from harness.run import launchers

    exp = experiment.load(write_toml(
        "[experiment]\nname = 's'\nmodels = ['qwen3-0.6b-tiny']\nseq_lens = [64, 128]\ndevice = 'cpu'\n"
        "dtype = 'fp32'\nbandwidth = false\n[variants.a]\nattn_implementation = 'sdpa'\n"))
    first, second = exp.points()
    root = tmp_path / "results"
    assert sweep.run(exp, root, progress=False).ran == 2
    path = res.results_path(root, "s", "cpu")
    before = res.read_rows(path)

    real = launchers.for_point

    class Stopped:
        def run(self, point, log_path, on_progress=None):
            _time.sleep(0.3)
            raise KeyboardInterrupt  # what the SIGTERM handler's SystemExit does too

    class Crashed:
        def run(self, point, log_path, on_progress=None):
            raise RuntimeError("a bug in the runner")

    # a crash is not a stop: it raises as itself and leaves no stopped row behind
    monkeypatch.setattr(sweep, "for_point", lambda p: Crashed() if p.point_id == second.point_id else real(p))
    with pytest.raises(RuntimeError, match="a bug in the runner"):
        sweep.run(exp, root, progress=False, overwrite=True)
    assert not [r for r in res.read_rows(path) if r.get("kind") == "stopped"]

    monkeypatch.setattr(sweep, "for_point", lambda p: Stopped() if p.point_id == second.point_id else real(p))
    with pytest.raises(KeyboardInterrupt):
        sweep.run(exp, root, progress=False, overwrite=True)
    rows = res.read_rows(path)
    (stop,) = [r for r in rows if r.get("kind") == "stopped"]
    assert stop["point_id"] == second.point_id and stop["wall_s"] >= 0.3 and "stopped" in stop["message"]
    # the earlier finished row of that point is kept: the stop loses nothing, and is not its result
    assert res.finished_point_ids(path) == {first.point_id, second.point_id}
    assert [r for r in rows if r.get("kind") == "step" and r["point_id"] == second.point_id] == \
        [r for r in before if r["point_id"] == second.point_id]
    assert res.point_wall_s(rows)[second.point_id] == max(stop["wall_s"], before[-1]["wall_s"])
    build_report(root, "s", tmp_path / "reports")  # the reports read past it
    # the next finished run of the point replaces the stopped row with its own
    monkeypatch.setattr(sweep, "for_point", real)
    sweep.run(exp, root, progress=False, overwrite=True)
    assert not [r for r in res.read_rows(path) if r.get("kind") == "stopped"]


def test_the_offload_section_gives_one_answer_per_length_the_newest_bench_run():
    """A bench rerun sizes its batch from the layer-input target: older code's point at another
    batch stayed in the results, and the report listed both (qwen3-14b 2048×10 and 2048×13) as if
    they were two measurements of the optimization. The section reads the newest run per length."""
    from harness.report.blog import offload

    def bench(batch, recorded_at, single, double):
        base = {"experiment": "offload", "gpu_slug": "nvidia-h100-80gb-hbm3", "device_name": "NVIDIA H100 80GB HBM3",
                "model": "qwen3-14b", "seq_len": 2048, "batch_size": batch}
        if recorded_at:
            base["recorded_at"] = recorded_at
        modes = [{**base, "kind": "offload", "mode": m, "status": "ok", "step_ms": {"p20": v, "p50": v, "p80": v}}
                 for m, v in (("none", double), ("single", single), ("double", double), ("save_on_cpu", single))]
        return [*modes, {**base, "kind": "offload_summary", "c_ms": 5.0, "g_ms": 100.0, "layers_reloaded": 38}]

    old, new = bench(10, None, 1100.0, 1000.0), bench(13, "2026-11-25T10:46:41+00:00", 1040.0, 1000.0)
    for rows in (old + new, new + old):  # file order does not decide it
        _, head = offload.section(rows, {}, Path("/nonexistent"), Path("/nonexistent"))
        assert head.measured["H100"] == "qwen3-14b 2048×13 +4.0 % steps/s over single"


def test_the_one_call_is_set_against_the_fastest_of_stock_stock_compiled_and_the_peer():
    def row(p50):
        return {"status": "ok", "step_ms": {"p20": p50, "p50": p50, "p80": p50}}

    p = data.RolePoint("gpu-x", "NVIDIA H100", "m", 2048, rows={"stock": row(800.0), "peer": row(600.0), "user": row(200.0)})
    assert p.over_fastest_peer() == (3.0, "peer")
    p.rows["stock"] = row(500.0)  # stock faster than the peer: the ratio is against stock
    assert p.over_fastest_peer() == (2.5, "stock")
    p.rows["stock-compiled"] = row(250.0)  # compiled stock, fastest of all three
    assert p.over_fastest_peer() == (1.25, "stock-compiled")
    p.rows["user"] = row(400.0)  # the one call slower than a peer: a ratio below 1, said as it is
    assert p.over_fastest_peer() == (0.625, "stock-compiled")
    del p.rows["user"]
    assert p.over_fastest_peer() == (None, None)


def test_a_context_step_is_left_while_a_search_is_not_over_or_owes_its_meeting_probe(tmp_path, write_toml, capsys):
    import dataclasses

    from harness import results as res
    from harness import row
    from harness.measure.env import code_id

    _tiny_experiment(tmp_path, "[variants.stock]\nrole = 'stock'\n[variants.user]\nrole = 'user'\n")
    p = write_toml("[blog]\nsources = { context = 'e' }\n[[blog.steps]]\nname = 'ctx'\ncontext = 'e.toml'\n"
                   "args = ['--max-len', '256', '--resolution', '64']\nestimate_s = 60\n", "plan.toml")
    step = plan.load(p).steps[0]
    assert step.argv(tmp_path)[:4] == ["-m", "harness", "context", str(tmp_path / "e.toml")]
    path = res.results_path(tmp_path / "r", "e", "cpu")

    exp = experiment.load(tmp_path / "e.toml")

    def identity(variant):  # the probe's point as the file defines it
        (point,) = [pt for pt in exp.points() if pt.variant == variant][:1]
        return row.identity(dataclasses.asdict(point))

    def probe(variant, n, status, code=None):
        res.append_row(path, {**identity(variant), "kind": "step", "seq_len": n, "status": status,
                              "env": {"code_id": code or code_id()}})

    assert reproduce.points_left(step, tmp_path, tmp_path / "r", "cpu") == (2, 2)  # nothing probed
    probe("stock", 64, "ok"), probe("stock", 128, "oom")  # bisected to 64 tokens: over at 64
    probe("user", 128, "ok"), probe("user", 256, "ok")  # at --max-len: over, but never at the peer's 64
    assert reproduce.points_left(step, tmp_path, tmp_path / "r", "cpu") == (1, 2)  # the meeting probe
    reproduce.status(p, "cpu", 80, results=tmp_path / "r")
    out = capsys.readouterr().out
    assert "ctx  1 of 2 searches left, at least ~1 min" in out  # apart from the points' totals
    assert "the long-context searches: 1 of 2 left, at least ~1 min" in out and "points left" not in out
    assert reproduce.run(p, results=tmp_path / "r", dry_run=True) == 0
    cmd = capsys.readouterr().err
    assert "run ctx: -m harness context" in cmd and "--stop-after" in cmd and "--resolution 64" in cmd, cmd
    # a call too short for one probe says so, rather than leaving the step for ever
    assert reproduce.run(p, minutes=0.5, results=tmp_path / "r", dry_run=True) == 0
    assert "skip ctx: it needs 60 s to start, more than --minutes 0.5 gives; run with --minutes 2" in \
        capsys.readouterr().err
    probe("user", 64, "ok")
    assert reproduce.points_left(step, tmp_path, tmp_path / "r", "cpu") == (0, 2)
    # another code's rows count only where the step keeps them
    probe("stock", 64, "ok", "other")
    kept = plan.Step(name="k", context="e.toml", args=("--keep-older-rows",))
    fresh = tmp_path / "fresh"
    res.append_row(res.results_path(fresh, "e", "cpu"), {**identity("stock"), "kind": "step", "seq_len": 64,
                                                         "status": "oom", "env": {"code_id": "other"}})
    assert reproduce.points_left(kept, tmp_path, fresh, "cpu")[0] == 1  # stock over at its first length; user not
    assert reproduce.points_left(plan.Step(name="n", context="e.toml"), tmp_path, fresh, "cpu")[0] == 2


def test_a_context_steps_search_that_ended_on_a_refused_probe_is_no_failure_of_the_plan(tmp_path, write_toml,
                                                                                         monkeypatch):
    import subprocess

    from harness.run import context

    _tiny_experiment(tmp_path, "[variants.stock]\nrole = 'stock'\n[variants.user]\nrole = 'user'\n")
    p = write_toml("[blog]\nsources = { context = 'e' }\n[[blog.steps]]\nname = 'ctx'\ncontext = 'e.toml'\n"
                   "estimate_s = 60\n", "plan.toml")
    monkeypatch.setattr(reproduce, "_gpu", lambda: ("GPU X", 80.0))
    ran = []
    for rc, want in ((context.ENDED_ON_A_FAILED_PROBE, 3), (1, 1)):  # left for the next call; a crash
        monkeypatch.setattr(subprocess, "run", lambda argv, rc=rc: ran.append(argv) or subprocess.CompletedProcess(argv, rc))
        assert reproduce.run(p, results=tmp_path / "r") == want
    assert len(ran) == 2 and ran[0][1:4] == ["-m", "harness", "context"]


def test_a_plan_step_is_one_of_a_sweep_a_bench_or_a_context_search(tmp_path, write_toml):
    _tiny_experiment(tmp_path)
    none = write_toml("[blog]\nsources = { context = 'e' }\n[[blog.steps]]\nname = 'x'\n", "n.toml")
    with pytest.raises(experiment.ExperimentError, match="exactly one of sweep"):
        plan.load(none)
    both = write_toml("[blog]\nsources = { context = 'e' }\n[[blog.steps]]\nsweep = 'e.toml'\ncontext = 'e.toml'\n",
                      "p.toml")
    with pytest.raises(experiment.ExperimentError, match="exactly one of sweep"):
        plan.load(both)
    missing = write_toml("[blog]\nsources = { context = 'e' }\n[[blog.steps]]\ncontext = 'nope.toml'\n", "q.toml")
    with pytest.raises(experiment.ExperimentError, match="'nope.toml' is not a file beside the plan"):
        plan.load(missing)
