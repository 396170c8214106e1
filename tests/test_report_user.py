"""The user's path section: stock, Liger and optim.enable side by side, computed from rows, and
the targets of [report.user] judged on those numbers (a skipped peer judges nothing)."""

import pytest

from harness.report import fmt
from harness.report.user import user_md, user_points, user_targets, variant_names

SPEC = {"stock": "stock", "liger": "liger", "user": "user", "targets": [
    {"model": "qwen3-8b", "seq_len": 8192, "min_speedup_over_liger": 1.3, "max_peak_over_liger": 1.0, "min_hfu": 0.45},
    {"model": "gpt-oss-20b", "seq_len": 2048, "max_user_ms": 270},
]}


def _row(model, seq_len, variant, p50, peak=None, hfu=None, status="ok", message=""):
    r = {"kind": "step", "gpu_slug": "h100", "model": model, "seq_len": seq_len, "variant": variant,
         "status": status, "message": message, "recorded_at": "2026-11-23T07:00:00+00:00", "env": {"git_sha": "abc"}}
    if status == "ok":
        r.update(step_ms={"p20": p50 - 1, "p50": p50, "p80": p50 + 1}, peak_allocated_gib=peak, hfu=hfu, flops_version=2)
    return r


ROWS = [
    _row("qwen3-8b", 8192, "stock", 1564.9, 32.1, 0.25), _row("qwen3-8b", 8192, "liger", 1251.5, 20.55, 0.31),
    _row("qwen3-8b", 8192, "user", 988.1, 20.87, 0.40), _row("qwen3-8b", 8192, "user-varlen", 1281.6, 20.87),
    _row("gpt-oss-20b", 2048, "stock", 646.4, 52.6), _row("gpt-oss-20b", 2048, "user", 236.5, 50.46),
    _row("gpt-oss-20b", 2048, "liger", None, status="skipped", message="Liger-Kernel is not installed"),
]


def test_points_compute_the_ratios_a_reader_asks_for():
    pts = {p["model"]: p for p in user_points(ROWS, SPEC)}
    q = pts["qwen3-8b"]
    assert round(q["over_liger"], 3) == round(1251.5 / 988.1, 3) and round(q["over_stock"], 3) == round(1564.9 / 988.1, 3)
    assert q["peak"] == {"stock": 32.1, "compiled": None, "liger": 20.55, "unsloth": None, "user": 20.87}
    assert list(q["others"]) == ["user-varlen"]
    # the headline: against the fastest peer measured here (Liger), not against eager stock
    assert (q["fastest_peer"], q["over_fastest"]) == ("liger", q["over_liger"])
    g = pts["gpt-oss-20b"]
    assert g["over_liger"] is None and g["rows"]["liger"]["status"] == "skipped"


def _goals(rows, spec, trainer_rows=None):
    """{target: (measured, met)} as user_md's targets table holds them."""
    return {g: (fmt.value(m), fmt.value(ok)) for g, m, ok in user_targets(user_points(rows, spec), spec["targets"],
                                                                          trainer_rows)}


def test_targets_are_judged_on_the_measured_values():
    goals = _goals(ROWS, SPEC)
    assert goals["user ≥ 1.3× faster than Liger, qwen3-8b at 8192 tokens (h100)"] == (pytest.approx(1251.5 / 988.1), False)
    assert goals["user peak ≤ 1× Liger's, qwen3-8b at 8192 tokens (h100)"] == ((pytest.approx(20.87 / 20.55), 20.87, 20.55), False)
    assert goals["user HFU ≥ 45%, qwen3-8b at 8192 tokens (h100)"] == (0.40, False)
    # a row of the older FLOP count (the lm_head counted as recomputed) judges no HFU, and says why
    old = [{k: v for k, v in r.items() if k != "flops_version"} for r in ROWS]
    assert _goals(old, SPEC)["user HFU ≥ 45%, qwen3-8b at 8192 tokens (h100)"] == (
        "recorded with an older FLOP count (the lm_head counted as recomputed): not judged", None)
    assert goals["user ≤ 270 ms, gpt-oss-20b at 2048 tokens (h100)"] == (236.5, True)
    with fmt.recording() as tables:
        assert user_md(ROWS, SPEC).startswith("## The user's path beside the peers")
    gpt = tables.find("user vs the fastest peer").row(model="gpt-oss-20b", tokens=2048)
    assert gpt["Liger-Kernel (`liger`) ms"] == "skipped: Liger-Kernel is not installed"
    assert (gpt["optim.enable (`user`) ms"], gpt["user vs liger"]) == (236.5, "–")


def test_no_rows_of_the_three_variants_is_no_section():
    assert user_md([_row("qwen3-8b", 8192, "other", 10.0, 1.0)], SPEC) == ""


def test_a_ratio_just_under_its_target_does_not_print_as_the_target():
    rows = [_row("qwen3-8b", 8192, "stock", 1577.4, 32.1), _row("qwen3-8b", 8192, "liger", 1259.6, 20.55),
            _row("qwen3-8b", 8192, "user", 972.1, 20.87)]
    (_, measured, met), *_ = user_targets(user_points(rows, SPEC), SPEC["targets"])
    assert (str(measured), measured.value, met.value) == ("1.296×", pytest.approx(1259.6 / 972.1), False)


def test_the_graphed_trainer_target_reads_the_trainer_bench_rows():
    spec = {**SPEC, "targets": [{"model": "gpt-oss-20b", "seq_len": 2048, "max_graphed_trainer_ms": 200}]}
    bench = [{"kind": "trainer", "gpu_slug": "h100", "model": "gpt-oss-20b", "tokens": 2048, "mode": mode,
              "status": "ok", "ms": ms} for mode, ms in (("ours", 339.3), ("graphed", 235.1))]
    goal = "GraphedTrainer ≤ 200 ms per step, gpt-oss-20b at 2048 tokens (h100)"
    assert _goals(ROWS, spec, bench)[goal] == (235.1, False)
    assert _goals(ROWS, spec)[goal] == ("not measured", None)  # no bench rows: judged on nothing
    # the newest row of that card, whatever the file order; never another card's or another rank's
    newer = {**bench[1], "ms": 190.0, "recorded_at": "2026-11-27T05:00:00+00:00", "env": {"git_sha": "0123456789"}}
    other_card = {**bench[1], "gpu_slug": "h200", "ms": 150.0, "recorded_at": "2026-11-28T05:00:00+00:00"}
    other_rank = {**newer, "lora_rank": 8, "ms": 100.0, "recorded_at": "2026-11-29T05:00:00+00:00"}
    rows = [*ROWS[:-2], {**ROWS[-2], "lora_rank": 16}, ROWS[-1]]
    assert _goals(rows, spec, [newer, *bench, other_card, other_rank])[goal] == (190.0, True)
    text = user_md(rows, spec, trainer_rows=[newer, *bench, other_card, other_rank])
    assert ("| 190.0 ms (`harness.bench.trainer`, 2026-11-27 at `0123456`; Trainer logging every step) | met |"
            in text)
    # a tree with changes at that commit measured other code than the commit's: the note says so,
    # unless a clean row of that commit measured the same sources
    dirty = {**newer, "env": {"git_sha": "0123456789", "git_dirty": True, "code_sha": "f00"}}
    text = user_md(rows, spec, trainer_rows=[dirty, *bench])
    assert "2026-11-27 at `0123456` (dirty); Trainer logging every step) | met |" in text
    clean = {**bench[0], "env": {"git_sha": "0123456789", "git_dirty": False, "code_sha": "f00"}}
    text = user_md(rows, spec, trainer_rows=[dirty, clean, *bench])
    assert "2026-11-27 at `0123456`; Trainer logging every step) | met |" in text
    # Trainer's default logging, what a user runs, judges before a newer row that logged every step
    usual = {**bench[1], "ms": 210.0, "logging_steps": 500, "recorded_at": "2026-11-26T05:00:00+00:00"}
    assert _goals(rows, spec, [newer, usual, *bench])[goal] == (210.0, False)
    # and so do Trainer's other defaults: a newer row that set TrainingArguments judges only alone,
    # and its note names them
    tuned = {**usual, "ms": 160.0, "trainer_args": {"bf16": False}, "recorded_at": "2026-11-28T05:00:00+00:00"}
    assert _goals(rows, spec, [tuned, usual, *bench])[goal] == (210.0, False)
    assert _goals(rows, spec, [tuned])[goal] == (160.0, True)
    assert "; bf16=False) | met |" in user_md(rows, spec, trainer_rows=[tuned])


def test_the_trainer_tables_compare_within_one_card():
    from harness.report.user import trainer_tables

    def row(gpu, mode, ms, at="2026-11-23T07:00:00+00:00"):
        return {"kind": "trainer", "gpu_slug": gpu, "device_name": gpu.upper(), "model": "m", "tokens": 2048,
                "lora_rank": 16, "mode": mode, "status": "ok", "ms": ms, "recorded_at": at, "steps": 30, "warmup": 10}

    with fmt.recording() as tables:
        text = trainer_tables([row("h100", "stock", 600.0), row("h100", "graphed", 300.0),
                               row("h200", "graphed", 200.0), row("h100", "graphed", 250.0, "2026-11-24T07:00:00+00:00")])
    assert ("**m** on the H100: 2048 tokens per step, LoRA r=16, Trainer logging every step (a host sync each "
            "step); fastest peer: stock Trainer + peft "
            "(of stock Trainer + peft only) (the modes' newest rows come from different runs)") in text
    h100, h200 = tables
    assert [r["× stock"] for r in h100.rows()] == [1.0, 600.0 / 250.0]  # the newest graphed row, over its own card's stock
    assert [r["× stock"] for r in h200.rows()] == ["–"]  # no stock on the H200: no ratio over the H100's
    assert [r["× fastest peer"] for r in h200.rows()] == ["–"]


def test_an_unsloth_row_drawn_from_other_weights_has_its_loss_diff_marked():
    """Rows from before Unsloth's loader read stock's weights compare two random draws: their diff
    is marked and the note says so; a row built from stock's weights is a plain figure."""
    from harness.report.user import trainer_tables

    def row(mode, losses, **kw):
        return {"kind": "trainer", "gpu_slug": "h100", "model": "m", "tokens": 2048, "lora_rank": 64, "mode": mode,
                "status": "ok", "ms": 100.0, "losses": losses, "recorded_at": "2026-11-28T07:00:00+00:00",
                "steps": 2, "warmup": 0, **kw}

    stock = row("stock", [10.0, 9.0])  # a row from before the field: stock's build all the same
    text = trainer_tables([stock, row("unsloth", [10.1, 9.0]), row("unsloth-nockpt", [10.0, 9.09], weights="stock"),
                           row("unsloth-sft", [10.0, 9.0], weights="Unsloth's own draw: no room"),
                           row("ours", [10.0, 9.18]), row("liger", None)])
    lines = {x.split(" | ")[0].lstrip("| "): x for x in text.splitlines() if x.startswith("| ")}
    assert "| 1.0e-02 ‡ |" in lines["Trainer on Unsloth's FastLanguageModel"]
    assert "| 0.0e+00 ‡ |" in lines["Unsloth's SFTTrainer"]
    assert "| 1.0e-02 |" in lines["Trainer on Unsloth's FastLanguageModel, no checkpointing"]
    assert "| 2.0e-02 |" in lines["Trainer after optim.enable(model)"]  # only Unsloth's loader draws
    assert "‡ Unsloth drew its own random weights" in text
    assert "‡" not in trainer_tables([stock, row("unsloth", [10.0, 9.0], weights="stock")])
    assert "‡" not in trainer_tables([row("unsloth", None)])  # no diff to mark, no note


def test_the_trainer_table_divides_by_the_fastest_peer_and_says_why_one_is_missing():
    from harness.report.user import trainer_tables

    def row(mode, ms, **kw):
        return {"kind": "trainer", "gpu_slug": "h100", "model": "m", "tokens": 2048, "lora_rank": 64, "mode": mode,
                "status": "ok", "ms": ms, "recorded_at": "2026-11-28T07:00:00+00:00", "steps": 30, "warmup": 10, **kw}

    with fmt.recording() as tables:
        text = trainer_tables([row("stock", 600.0), row("compiled", 400.0), row("ours", 200.0), row("graphed", 160.0),
                               row("liger", None, status="skipped", error="Liger-Kernel is not installed")])
    (t,) = tables
    assert [r["× fastest peer"] for r in t.rows()] == [400.0 / 600.0, 1.0, "–", 2.0, 2.5]  # over compiled, not stock
    assert [r["× stock"] for r in t.rows()][-2:] == [3.0, 600.0 / 160.0]
    assert "fastest peer: stock Trainer, decoder layers compiled (of stock Trainer + peft, stock Trainer, " \
           "decoder layers compiled only)" in text
    assert "| Trainer(use_liger_kernel=True) | skipped: Liger-Kernel is not installed |" in text
    # a skipped peer is never the fastest: with every peer shown, the note names no subset
    with fmt.recording() as tables:
        text = trainer_tables([row("stock", 600.0), row("compiled", 400.0), row("liger", 300.0), row("ours", 200.0),
                               row("stock-nockpt", 500.0), row("compiled-nockpt", 350.0), row("liger-nockpt", 320.0),
                               row("unsloth", 330.0), row("unsloth-nockpt", 310.0),
                               row("unsloth-sft", 305.0, batching="padded rows"), row("unsloth-sft-nockpt", 301.0)])
    assert "fastest peer: Trainer(use_liger_kernel=True)" in text and "only)" not in text
    assert [r["× fastest peer"] for r in tables[0].rows()] == [0.5, 0.75, 1.0, 300 / 330, 300 / 305, 0.6, 300 / 350,
                                                                300 / 320, 300 / 310, 300 / 301, 1.5]
    assert "| Unsloth's SFTTrainer (padded rows) | 305.0 [" in text  # what Unsloth chose for itself
    # a peer without checkpointing that is faster is the denominator
    with fmt.recording() as tables:
        text = trainer_tables([row("stock", 600.0), row("compiled", 400.0), row("liger", 300.0), row("ours", 200.0),
                               row("stock-nockpt", 500.0), row("compiled-nockpt", 250.0), row("liger-nockpt", 320.0)])
    assert "fastest peer: stock Trainer, decoder layers compiled, no checkpointing" in text
    assert tables[0].rows()[-1]["× fastest peer"] == 1.25
    # Trainer's default logging is another measurement than a log (and a sync) every step: its own table
    with fmt.recording() as tables:
        text = trainer_tables([row("stock", 600.0), row("ours", 200.0),
                               row("stock", 590.0, logging_steps=500), row("ours", 150.0, logging_steps=500)])
    assert [[r["× stock"] for r in t.rows()] for t in tables] == [[1.0, 3.0], [1.0, 590.0 / 150.0]]
    assert "LoRA r=64, Trainer logging every 500 steps; fastest peer" in text


def test_the_trainer_tables_loss_diff_is_read_against_the_stock_row_shown_beside_it():
    from harness.report.user import trainer_tables

    def row(mode, losses, at="2026-11-28T07:00:00+00:00", **kw):
        return {"kind": "trainer", "gpu_slug": "h200", "model": "m", "tokens": 2048, "lora_rank": 64, "mode": mode,
                "status": "ok", "ms": 300.0, "recorded_at": at, "steps": 3, "warmup": 1, "losses": losses, **kw}

    with fmt.recording() as tables:
        trainer_tables([row("stock", [12.0, 11.0, 10.0], "2026-11-28T06:00:00+00:00"),  # an older stock row
                        row("stock", [10.0, 10.0, 10.0]),
                        # a run of another invocation than stock's: no figure of its own, its losses compared
                        row("compiled", [10.0, 10.1, 9.8]),
                        # its own figure is against the older stock it ran beside; the table's stock is newer
                        row("ours", [10.0, 10.0, 10.05], max_rel_loss_diff_vs_stock=0.2),
                        # losses that cannot be paired step by step: the row's own figure
                        row("graphed", [10.0, 10.0], max_rel_loss_diff_vs_stock=3e-3)])
    diffs = {r["run"]: r["loss diff"] for r in tables[0].rows()}
    assert diffs == {"stock Trainer + peft": "0.0e+00", "stock Trainer, decoder layers compiled": "2.0e-02",
                     "Trainer after optim.enable(model)": "5.0e-03", "optim.trainer.GraphedTrainer": "3.0e-03"}


def test_the_three_columns_are_read_from_the_rows_roles_where_the_spec_names_none():
    roles = {"stock": ("stock", ""), "liger": ("peer", "liger"), "user": ("user", "user"),
             "user-varlen": ("ablation", "user")}
    rows = [{**r, "baseline_variant": "stock", "role": roles[r["variant"]][0], "stack": roles[r["variant"]][1]}
            for r in ROWS]
    targets = {"targets": SPEC["targets"]}
    assert variant_names(rows, targets) == {"stock": ("stock",), "compiled": (), "liger": ("liger",), "unsloth": (),
                                            "user": ("user",)}
    def seen(pts):
        return [(p["model"], p["ms"], p["over_stock"], p["over_liger"], list(p["others"])) for p in pts]
    assert seen(user_points(rows, targets)) == seen(user_points(ROWS, SPEC))
    # an older row's ours-default with the user's stack is the user's path too
    older = [{**r, "role": "ours-default"} if r["variant"] == "user" else r for r in rows]
    assert variant_names(older, targets)["user"] == ("user",)
    # two variants of role user: the spec must choose, else the column is empty
    two = rows + [{**r, "variant": "user-2"} for r in rows if r["variant"] == "user"]
    assert variant_names(two, targets)["user"] == () and variant_names(two, {"user": "user-2"})["user"] == ("user-2",)
    with fmt.recording() as tables:
        user_md(two, targets)
    assert "optim.enable (`–`) ms" in tables[0].header


def test_every_committed_user_experiment_finds_its_columns_by_role():
    from pathlib import Path

    from harness.run import experiment

    files = [p for p in sorted((Path(__file__).resolve().parents[1] / "experiments").glob("*.toml"))
             if "[report.user]" in p.read_text()]
    assert len(files) >= 4
    for path in files:
        exp = experiment.load(path)
        fields = [vars(p) for p in exp.points()]
        names = variant_names(fields, exp.report["user"])
        # Unsloth where the file builds it; the other columns in every file
        want = [c for c in names if c != "unsloth" or any(f.get("stack") == "unsloth" for f in fields)]
        assert all(names[c] for c in want), path.name
        if path.name == "user.toml":
            assert names["unsloth"] == ("unsloth", "unsloth-nockpt")  # with and without checkpointing


def test_a_compiled_stock_faster_than_the_other_peers_is_the_headline_denominator():
    rows = [{**_row("qwen3-0.6b", 8192, v, ms, 2.0), "baseline_variant": "stock", "role": role, "stack": stack}
            for v, ms, role, stack in (("stock", 514.0, "stock", ""), ("stock-compiled", 187.7, "stock-compiled", "compiled"),
                                        ("liger", 470.0, "peer", "liger"), ("user", 206.8, "user", "user"))]
    (p,) = user_points(rows, {})
    assert p["fastest_peer"] == "compiled" and round(p["over_fastest"], 4) == round(187.7 / 206.8, 4)
    assert round(p["over_stock"], 4) == round(514.0 / 206.8, 4)  # eager stock stays a column
    with fmt.recording() as tables:
        user_md(rows, {})
    row = tables.find("user vs the fastest peer").row(model="qwen3-0.6b")
    assert row["user vs the fastest peer"] == (pytest.approx(187.7 / 206.8), "stock + compile")
    assert row["stock + compile (`stock-compiled`) ms"] == 187.7


def test_the_columns_come_from_the_latest_run_that_measured_the_user_beside_a_peer():
    """A later run of the user's path and the peers replaces an earlier one whole: its rows are not
    mixed with the earlier run's by a median over both; an ablation only the earlier run has is
    listed with no ratio against the later user row."""
    def at(r, when, code):
        return {**r, "recorded_at": when, "env": {"code_sha": code}}

    old = [at(r, "2026-11-23T07:00:00+00:00", "a") for r in ROWS if r["model"] == "gpt-oss-20b"]
    old.append(at(_row("gpt-oss-20b", 2048, "ours-graph", 216.5, 50.6), "2026-11-23T07:05:00+00:00", "a"))
    new = [at(_row("gpt-oss-20b", 2048, v, ms, pk), "2026-11-26T06:40:00+00:00", "b")
           for v, ms, pk in (("stock", 648.4, 52.6), ("liger", 613.8, 52.57), ("user", 156.0, 56.78))]
    (p,) = user_points(old + new, SPEC)
    assert p["ms"] == {"stock": 648.4, "compiled": None, "liger": 613.8, "unsloth": None, "user": 156.0}
    assert p["over_liger"] == pytest.approx(613.8 / 156.0)
    assert fmt.stat(p["others"]["ours-graph"], "step_ms") == 216.5 and not p["others_same_run"]["ours-graph"]
    with fmt.recording() as tables:
        user_md(old + new, SPEC)
    assert tables.find("vs user").row(variant="ours-graph")["vs user"] == "other run"


def test_a_target_that_names_a_variant_judges_that_variants_row_against_the_same_peers():
    rows = [{**_row("qwen3-8b", 8192, v, ms, peak), "baseline_variant": "stock", "role": role, "stack": stack}
            for v, ms, peak, role, stack in (("stock", 1570.3, 32.10, "stock", ""),
                                              ("stock-compiled", 984.8, 32.10, "stock-compiled", "compiled"),
                                              ("liger", 1251.0, 20.55, "peer", "liger"),
                                              ("unsloth", 1104.7, 17.38, "unsloth", "unsloth"),
                                              ("user", 701.7, 70.83, "user", "user"),
                                              ("user-lowmem", 973.8, 19.02, "ablation", "user"))]
    spec = {"targets": [
        {"model": "qwen3-8b", "seq_len": 8192, "max_peak_over_lowest": 1.0, "min_speedup_over_fastest": 1.25},
        {"model": "qwen3-8b", "seq_len": 8192, "variant": "user-lowmem", "max_peak_over_lowest": 1.0,
         "min_speedup_over_fastest": 1.0},
        {"model": "qwen3-8b", "seq_len": 8192, "variant": "not-run", "max_peak_over_lowest": 1.0}]}
    goals = _goals(rows, spec)
    at = ", qwen3-8b at 8192 tokens (h100)"
    assert goals["user ≥ 1.25× faster than the fastest peer" + at] == (pytest.approx(984.8 / 701.7), True)
    assert goals["user peak ≤ 1× the lowest peer's" + at][1] is False
    assert goals["`user-lowmem` ≥ 1× faster than the fastest peer" + at] == (pytest.approx(984.8 / 973.8), True)
    assert goals["`user-lowmem` peak ≤ 1× the lowest peer's" + at] == ((pytest.approx(19.02 / 17.38), 19.02, 17.38), False)
    assert goals["`not-run` peak ≤ 1× the lowest peer's" + at] == ("not measured", None)
    # without Liger-Kernel at the point, a target against the fastest or the lowest peer is not judged
    text = user_md([r for r in rows if r["variant"] != "liger"], spec)
    assert (f"| user ≥ 1.25× faster than the fastest peer{at} | {984.8 / 701.7:.3f}× (vs stock + compile; "
            "Liger-Kernel not run) | – |") in text
    assert f"| `user-lowmem` peak ≤ 1× the lowest peer's{at} | {19.02 / 17.38:.3f}× (19.02 vs Unsloth's 17.38 GiB; " \
           "Liger-Kernel not run) | – |" in text


def test_a_peer_only_a_later_partial_run_measured_still_sets_the_fastest_and_the_lowest():
    """A later run of some peers alone (a partial rerun, or the rest of a sweep killed halfway)
    supersedes their earlier rows; the user's run then lacks them. The fastest peer and the lowest
    peak are still of every peer measured at the point, each marked as from another run: a ratio
    against a slower peer would overstate the user's path."""
    def at(r, when, code):
        return {**r, "recorded_at": when, "env": {"code_sha": code}, "baseline_variant": "stock"}

    roles = {"stock": ("stock", ""), "stock-compiled": ("stock-compiled", "compiled"), "liger": ("peer", "liger"),
             "unsloth": ("unsloth", "unsloth"), "user": ("user", "user")}

    def row(v, ms, peak, when, code):
        return {**at(_row("qwen3-0.6b", 8192, v, ms, peak), when, code), "role": roles[v][0], "stack": roles[v][1]}

    old = [row(v, ms, pk, "2026-11-26T22:10:00+00:00", "a")
           for v, ms, pk in (("stock", 469.8, 15.67), ("liger", 433.6, 2.47), ("user", 105.6, 11.21))]
    new = [row(v, ms, pk, "2026-11-27T12:13:00+00:00", "b")
           for v, ms, pk in (("stock-compiled", 237.2, 15.67), ("unsloth", 866.9, 1.80))]
    (p,) = user_points(old + new, {})
    assert (p["fastest_peer"], p["elsewhere"]) == ("compiled", {"compiled", "unsloth"})
    assert p["over_fastest"] == pytest.approx(237.2 / 105.6)
    spec = {"targets": [{"model": "qwen3-0.6b", "seq_len": 8192, "min_speedup_over_fastest": 1.2,
                         "max_peak_over_lowest": 1.2}]}
    goals = {g: m for g, m, _ in user_targets([p], spec["targets"])}
    at_ = ", qwen3-0.6b at 8192 tokens (h100)"
    assert str(goals["user ≥ 1.2× faster than the fastest peer" + at_]).endswith("(vs stock + compile, another run)")
    assert "Unsloth's 1.80 GiB, another run" in str(goals["user peak ≤ 1.2× the lowest peer's" + at_])
    md = user_md(old + new, {})
    assert "| 237.2 [236.2–238.2] † |" in md and "| 433.6 [432.6–434.6] |" in md  # Liger is the user's run
    # a variant the partial run measured is judged in that run, beside the peers it measured
    lowmem = {**at(_row("qwen3-0.6b", 8192, "user-lowmem", 258.3, 1.84), "2026-11-27T12:15:00+00:00", "b"),
              "role": "ablation", "stack": "user"}
    (p,) = user_points(old + new + [lowmem], {})
    spec = {"targets": [{"model": "qwen3-0.6b", "seq_len": 8192, "variant": "user-lowmem",
                         "min_speedup_over_fastest": 1.0, "max_peak_over_lowest": 1.2}]}
    goals = {g: (fmt.value(m), str(m), fmt.value(ok)) for g, m, ok in user_targets([p], spec["targets"])}
    speed = goals["`user-lowmem` ≥ 1× faster than the fastest peer" + at_]
    assert speed[0] == pytest.approx(237.2 / 258.3) and speed[1].endswith("(vs stock + compile)") and speed[2] is False
    assert goals["`user-lowmem` peak ≤ 1.2× the lowest peer's" + at_][0] == (pytest.approx(1.84 / 1.80), 1.84, 1.80)


def test_a_peer_variant_the_users_run_lacks_still_sets_the_lowest_peak():
    """A partial rerun of the user's path beside one of a peer's two variants (Unsloth without
    checkpointing) leaves the peer's other variant (checkpointed, the lower peak) in the earlier
    run. The lowest peak is still that variant's, marked as from another run, and not a higher peak
    of another peer; a variant that ran out of memory in the user's run is not filled in from an
    older run."""
    roles = {"stock": ("stock", ""), "stock-compiled": ("stock-compiled", "compiled"), "unsloth": ("unsloth", "unsloth"),
             "unsloth-nockpt": ("unsloth", "unsloth"), "user": ("user", "user")}

    def row(v, ms, peak, when, code, **kw):
        return {**_row("gpt-oss-20b", 2048, v, ms, peak, **kw), "recorded_at": when, "env": {"code_sha": code},
                "baseline_variant": "stock", "role": roles[v][0], "stack": roles[v][1]}

    old = [row(v, ms, pk, "2026-11-29T08:10:00+00:00", "a")
           for v, ms, pk in (("stock", 540.5, 52.60), ("stock-compiled", 328.1, 52.53), ("unsloth", 312.5, 50.86),
                             ("unsloth-nockpt", 266.9, 58.17), ("user", 142.8, 56.18))]
    new = [row(v, ms, pk, "2026-11-29T09:45:00+00:00", "b")
           for v, ms, pk in (("unsloth-nockpt", 268.1, 58.17), ("user", 125.7, 56.18))]
    (p,) = user_points(old + new, {})
    assert (p["fastest_peer"], p["elsewhere"]) == ("unsloth", {"stock", "compiled"})
    assert p["peak"]["unsloth"] == 50.86 and p["peak_elsewhere"] == {"stock", "compiled", "unsloth"}
    spec = {"targets": [{"model": "gpt-oss-20b", "seq_len": 2048, "max_peak_over_lowest": 1.0}]}
    ((goal, measured, met),) = user_targets([p], spec["targets"])
    assert str(measured) == f"{56.18 / 50.86:.3f}× (56.18 vs Unsloth's 50.86 GiB, another run; Liger-Kernel not run)"
    # the checkpointed variant out of memory in the user's run: its failure is the newest word on it
    oom = row("unsloth", None, None, "2026-11-29T09:44:00+00:00", "b", status="oom", message="CUDA out of memory")
    (p,) = user_points(old + new + [oom], {})
    assert p["peak"]["unsloth"] == 58.17 and "unsloth" not in p["peak_elsewhere"]
    # a memory-first variant of the earlier run, whose Unsloth without checkpointing a later run
    # superseded: judged against that faster Unsloth row, not the slower checkpointed one beside it
    roles["user-lowmem"] = ("ablation", "user")
    earlier = [r for r in old if r["variant"] not in ("unsloth-nockpt", "user")]
    earlier.append(row("user-lowmem", 192.8, 50.44, "2026-11-29T08:15:00+00:00", "a"))
    (p,) = user_points(earlier + new, {})
    spec = {"targets": [{"model": "gpt-oss-20b", "seq_len": 2048, "variant": "user-lowmem",
                         "min_speedup_over_fastest": 1.0, "max_peak_over_lowest": 1.0}]}
    speed, mem = user_targets([p], spec["targets"])
    assert fmt.value(speed[1]) == pytest.approx(268.1 / 192.8) and "(vs Unsloth, another run;" in str(speed[1])
    assert fmt.value(mem[1]) == (pytest.approx(50.44 / 50.86), 50.44, 50.86) and "another run" not in str(mem[1])
    # the table marks a peak read from another run, beside a step of the user's run
    md = user_md(old + new, {})
    assert "| 52.60 † / 52.53 † / – / 50.86 † / 56.18 |" in md and "| 268.1 [267.1–269.1] |" in md
    # a peer whose only variant in the user's run ran out of memory keeps that failure: an older
    # row of its other variant does not stand in for it
    lone = [row("unsloth", None, None, "2026-11-29T09:44:00+00:00", "b", status="oom", message="CUDA out of memory")]
    (p,) = user_points([r for r in old if r["variant"] != "unsloth"] + [x for x in new if x["variant"] == "user"] + lone
                       + [row("stock", 541.0, 52.60, "2026-11-29T09:43:00+00:00", "b")], {})
    assert p["rows"]["unsloth"]["status"] == "oom" and p["peak"]["unsloth"] is None
    assert "unsloth" not in p["elsewhere"] | p["peak_elsewhere"] and p["fastest_peer"] == "compiled"


def test_a_variant_with_no_peer_in_its_latest_run_and_a_peer_that_failed_are_not_filled_in():
    """A variant whose latest run measured no peer is not judged across runs; a variant judged in a
    paired run is not, once a later run measured it alone. A peer that failed in the user's run
    keeps its failure rather than an older run's time."""
    def row(v, ms, when, status="ok", role="ablation", stack="user"):
        r = {**_row("qwen3-8b", 8192, v, ms, 20.0, status=status), "recorded_at": when,
             "env": {"code_sha": when[:13]}, "baseline_variant": "stock", "role": role, "stack": stack}
        return r

    run1 = [row("stock", 1500.0, "2026-11-26T10:00:00+00:00", role="stock", stack=""),
            row("liger", 1200.0, "2026-11-26T10:01:00+00:00", role="peer", stack="liger"),
            row("stock-compiled", 1600.0, "2026-11-26T10:01:10+00:00", role="stock-compiled", stack="compiled"),
            row("unsloth", 1700.0, "2026-11-26T10:01:20+00:00", role="unsloth", stack="unsloth"),
            row("user", 600.0, "2026-11-26T10:02:00+00:00", role="user"),
            row("lowmem", 800.0, "2026-11-26T10:03:00+00:00")]
    alone = [row("lowmem", 500.0, "2026-11-27T10:00:00+00:00")]
    spec = {"targets": [{"model": "qwen3-8b", "seq_len": 8192, "variant": "lowmem", "min_speedup_over_fastest": 1.0}]}
    goal = "`lowmem` ≥ 1× faster than the fastest peer, qwen3-8b at 8192 tokens (h100)"
    assert _goals(run1, spec)[goal] == (pytest.approx(1200.0 / 800.0), True)
    assert _goals(run1 + alone, spec)[goal] == ("not measured", None)  # neither 800 (stale) nor 500 (no peer)
    oom = [row("stock", 1490.0, "2026-11-27T11:00:00+00:00", role="stock", stack=""),
           row("user", 610.0, "2026-11-27T11:01:00+00:00", role="user"),
           row("liger", None, "2026-11-27T11:02:00+00:00", status="oom", role="peer", stack="liger")]
    (p,) = user_points(run1 + oom, {})
    assert p["rows"]["liger"]["status"] == "oom" and p["elsewhere"] == {"compiled", "unsloth"}  # run1's, marked
    assert p["fastest_peer"] == "stock" and p["over_fastest"] == pytest.approx(1490.0 / 610.0)


def test_a_peer_run_with_and_without_checkpointing_is_one_column_at_its_faster():
    """A competent user turns checkpointing off where the model fits: the column of a peer run both
    ways shows, at each point, the faster of the two, and the headline ratio is against it."""
    def peer(v, ms, role, stack, peak=30.0):
        return {**_row("qwen3-8b", 8192, v, ms, peak), "baseline_variant": "stock", "role": role, "stack": stack}

    rows = [peer("stock", 1500.0, "stock", ""), peer("stock-compiled", 985.0, "stock-compiled", "compiled", 18.0),
            peer("stock-compiled-nockpt", 760.0, "stock-compiled", "compiled", 60.0), peer("liger", 1250.0, "peer", "liger"),
            peer("user", 569.0, "user", "user")]
    names = variant_names(rows, {})
    assert names["compiled"] == ("stock-compiled", "stock-compiled-nockpt")
    (p,) = user_points(rows, {})
    assert p["rows"]["compiled"]["variant"] == "stock-compiled-nockpt" and p["fastest_peer"] == "compiled"
    assert round(p["over_fastest"], 4) == round(760.0 / 569.0, 4) and "stock-compiled-nockpt" not in p["others"]
    assert p["peak"]["compiled"] == 18.0  # its memory is the checkpointed variant's: the lower of the two
    text = user_md(rows, {})
    assert "stock + compile (`stock-compiled / stock-compiled-nockpt`) ms" in text


def test_a_ratio_whose_spreads_overlap_is_marked_and_explained():
    rows = [_row("qwen3-8b", 8192, "stock", 900.0, 30.0), _row("qwen3-8b", 8192, "liger", 258.8, 20.0),
            _row("qwen3-8b", 8192, "user", 254.3, 21.0)]
    rows[1]["step_ms"].update(p20=255.8, p80=264.8)
    rows[2]["step_ms"].update(p20=246.3, p80=263.2)
    text = user_md(rows, {"stock": "stock", "liger": "liger", "user": "user"})
    assert f"1.01× (Liger-Kernel) {fmt.OVERLAP}" in text and fmt.OVERLAP_NOTE in text
    rows[2]["step_ms"].update(p80=250.0)  # the spreads apart: no mark, no note
    text = user_md(rows, {"stock": "stock", "liger": "liger", "user": "user"})
    assert fmt.OVERLAP not in text
