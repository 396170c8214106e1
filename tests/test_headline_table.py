"""The README headline's ratio cells and sentences: against the fastest peer that ran, and saying how many
of the peers ran where some did not (a point measured beside stock and Liger alone cannot claim
its ratio is against the fastest of all four)."""

from harness.report import cite, headline
from harness.report.runs import other_code
from harness.report.blog.data import RolePoint


def _row(variant, ms, peak):
    return {"kind": "step", "variant": variant, "point_id": f"p-{variant}", "status": "ok", "model": "qwen3-8b", "seq_len": 8192,
            "lora_rank": 16, "experiment": "user", "gpu_slug": "nvidia-h200", "device_name": "NVIDIA H200", "env": {"git_sha": "abcdef0123"},
            "recorded_at": "2026-11-23T17:40:00+00:00", "step_ms": {"p20": ms - 1, "p50": ms, "p80": ms + 1},
            "peak_allocated_gib": peak}


def _point(**roles):
    p = RolePoint(gpu="nvidia-h200", device="NVIDIA H200", model="qwen3-8b", seq_len=8192)
    p.rows = {role: _row(role, ms, peak) for role, (ms, peak) in roles.items()}
    return p


def _ratio_cell(p):
    head, _, row = headline._table(cite.Figures(), [p], other_code(list(p.rows.values()))).splitlines()
    cells = dict(zip(head.strip("|").split(" | "), row.strip("|").split(" | ")))
    return cells["enable() against the fastest other"].strip()


def test_a_point_without_every_peer_says_how_many_ran():
    some = _point(stock=(1423.3, 32.1), peer=(1166.6, 20.55), user=(935.4, 20.87))
    cell = _ratio_cell(some)
    # 1166.6 / 935.4 = 1.2472: shown rounded down, never as the 1.25× a target of 1.25 would call met
    assert cell == "1.24× (Liger-Kernel, 2 of 4 peers run)", cell
    some.failed["unsloth"] = "oom"  # a peer that ran and failed counts as run: it could not be faster
    assert _ratio_cell(some) == "1.24× (Liger-Kernel, 3 of 4 peers run)"
    some.failed["unsloth"] = "skipped"  # not installed: it did not run, and might have been the fastest
    assert _ratio_cell(some) == "1.24× (Liger-Kernel, 2 of 4 peers run)"
    every = _point(stock=(1567.1, 32.1), **{"stock-compiled": (984.9, 32.1)}, peer=(1250.8, 20.55),
                   unsloth=(1133.0, 17.38), user=(569.0, 54.48))
    assert _ratio_cell(every) == "1.73× (stock + torch.compile)"


def test_a_ratio_is_rounded_down_and_reads_back_through_its_key():
    from harness.report import fmt
    assert fmt.times_text(1.2499) == "1.24×" and fmt.times_text(1.25) == "1.25×" and fmt.times_text(125 / 100) == "1.25×"
    assert fmt.times_text(0.999) == "0.99×" and fmt.times_text(2.0) == "2.00×"
    f = cite.Figures()
    shown = f.ratio(_row("a", 1166.6, 1.0), _row("b", 935.4, 1.0))
    assert shown == "1.24×" and cite.FORMATS["ratio"](1166.6 / 935.4) == shown


def _timed(role, ms, at, status="ok", **extra):
    r = _row(role, ms, 10.0)
    r.update(role=role, point_id=f"p-{role}-{at}", recorded_at=f"2026-11-23T{at}:00+00:00", status=status, **extra)
    r["baseline_variant"] = "stock"
    if role == "peer":
        r["stack"] = "liger"
    if status != "ok":
        r.pop("step_ms")
    return r


def test_a_peer_that_failed_in_the_newest_run_is_shown_failed_not_taken_from_an_older_run():
    from harness.report.blog import data
    old = [_timed("stock", 1400, "08:00"), _timed("peer", 1200, "08:01"), _timed("unsloth", 100, "08:02"),
           _timed("user", 200, "08:03")]
    new = [_timed("stock", 1400, "12:00"), _timed("peer", 1200, "12:01"), _timed("unsloth", 0, "12:02", status="oom"),
           _timed("user", 200, "12:03")]
    for r in old + new:
        r["variant"] = r["role"]
    (p,) = data.role_points(old + new)
    assert "unsloth" not in p.rows and p.failed["unsloth"] == "oom"
    assert p.over_fastest_peer() == (1200 / 200, "peer")
    assert p.rows["user"]["recorded_at"].startswith("2026-11-23T12")


def test_the_headline_and_the_user_report_take_the_same_median_of_two_repeats():
    from harness.report import user as user_report
    from harness.report.blog import data
    rows = [_timed("user", 200, "12:00"), _timed("user", 240, "12:01")]
    for r in rows:
        r["variant"] = "user"
    assert data._median_repeat(rows) is user_report._best(rows, "user") is rows[1]


def test_the_range_sentence_keeps_points_without_every_peer_apart():
    every = _point(stock=(1567.1, 32.1), **{"stock-compiled": (984.9, 32.1)}, peer=(1250.8, 20.55),
                   unsloth=(1133.0, 17.38), user=(569.0, 54.48))
    some = _point(stock=(1423.3, 32.1), peer=(1166.6, 20.55), user=(935.4, 20.87))
    some.model = "qwen3-14b"
    text = headline._range(cite.Figures(), "packing", [every, some])
    assert "over the 1 point one run measured beside every peer" in text and "1.73× at qwen3-8b" in text
    assert "At 1 more point, not every peer ran (Unsloth, stock + torch.compile missing at some)" in text
    assert "1.24× at qwen3-14b 8192 on the H200 (against Liger-Kernel, 2 of 4 peers run)" in text
    only_some = headline._range(cite.Figures(), "packing", [some])
    assert only_some.startswith("**packing** (`experiments/packing.toml`): Over the 1 point one run measured, not every peer ran")


def test_a_peer_with_and_without_checkpointing_is_its_faster_step_and_its_lower_peak():
    """The ratio is against the faster of a peer's two variants; the memory cell against the lower
    peak of them: a user chooses one or the other, and each figure takes that user's choice."""
    from harness.report.blog import data

    rows = []
    for variant, role, stack, ms, peak in (("stock", "stock", "", 1500.0, 30.0),
                                           ("stock-compiled", "stock-compiled", "compiled", 985.0, 32.1),
                                           ("stock-compiled-nockpt", "stock-compiled", "compiled", 760.0, 60.0),
                                           ("liger", "peer", "liger", 1250.0, 20.55), ("user", "user", "user", 569.0, 54.48)):
        r = _row(variant, ms, peak)
        r.update(role=role, stack=stack, baseline_variant="stock", point_id=f"p-{variant}")
        rows.append(r)
    (p,) = data.role_points(rows)
    assert p.rows["stock-compiled"]["variant"] == "stock-compiled-nockpt"
    assert p.low["stock-compiled"]["variant"] == "stock-compiled"
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    cells = dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))
    assert cells["enable() against the fastest other"].startswith("1.33× (stock + torch.compile")  # 760 / 569
    assert cells["peak, enable() / the lowest other"].strip() == "54.48 GiB / 20.55 GiB"
    assert cells["stock + torch.compile"].strip() == "760.0 ms"  # no mark: the row names no switch
    p.rows["stock-compiled"]["switches"] = {"gradient_checkpointing": False}
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    cells = dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))
    assert cells["stock + torch.compile"].strip() == "760.0 ms ‡" and cells["Liger-Kernel"].strip() == "1250.0 ms"
    assert cells["commit"].strip() == "`abcdef0`"
    p.rows["user"]["switches"] = {"gradient_checkpointing": False}  # the mark is a peer's alone
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    assert dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))["`optim.enable(model)`"].strip() == "569.0 ms"
    p.rows["user"]["env"] = {"git_sha": "abcdef0123", "git_dirty": True, "code_sha": "c0de"}  # changes on top
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    assert dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))["commit"].strip() == "`abcdef0` (dirty)"
    # a clean row of the commit that ran the same measuring code: the tree's change was elsewhere
    # (the rows the sweep had appended to results/ before this one)
    rows[0]["env"] = {"git_sha": "abcdef0123", "git_dirty": False, "code_sha": "c0de"}
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    assert dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))["commit"].strip() == "`abcdef0`"
    rows[0]["env"]["code_sha"] = "other"  # the clean row ran other code: it vouches for nothing
    head, _, line = headline._table(cite.Figures(), [p], other_code(rows)).splitlines()
    assert dict(zip(head.strip("|").split(" | "), line.strip("|").split(" | ")))["commit"].strip() == "`abcdef0` (dirty)"


def test_the_memory_first_sentence_reads_each_peers_lowest_peak_not_its_fastest_variants(tmp_path):
    """A peer run with and without checkpointing: the memory-first variant's peak is set against the
    lower peak of the two (the checkpointed one), as the user report's target judges it, not the
    no-checkpoint variant's that the ratio is against."""
    import json

    exp = tmp_path / "user" / "experiments"
    exp.mkdir(parents=True)
    (exp / "0123456789abcdef.toml").write_text(  # the only kept file: the rows name none
        '[experiment]\nname = "user"\nmodels = ["qwen3-8b"]\nseq_lens = [8192]\ndevice = "cuda"\n'
        'baseline = "stock"\n[variants.stock]\nrole = "stock"\n[variants.unsloth]\nstack = "unsloth"\n'
        '[variants.unsloth-nockpt]\nstack = "unsloth"\ngradient_checkpointing = false\n'
        '[variants.user]\nrole = "user"\n[variants.lowmem]\nrole = "ablation"\nstack = "user"\nrecompute = "all"\n'
        '[report.user]\ntargets = [{ model = "qwen3-8b", seq_len = 8192, variant = "lowmem", '
        'min_speedup_over_fastest = 1.0, max_peak_over_lowest = 1.0 }]\n')
    rows = []
    for i, (variant, role, stack, ms, peak) in enumerate((
            ("stock", "stock", "", 1400.0, 32.1), ("unsloth", "unsloth", "unsloth", 910.0, 17.38),
            ("unsloth-nockpt", "unsloth", "unsloth", 680.0, 50.55), ("user", "user", "user", 540.0, 54.48),
            ("lowmem", "ablation", "user", 750.0, 17.65))):
        r = _row(variant, ms, peak)
        r.update(role=role, stack=stack, baseline_variant="stock",
                 recorded_at=f"2026-11-27T22:0{i}:00+00:00", switches={"recompute": "all"} if variant == "lowmem" else {})
        rows.append(r)
    (tmp_path / "user" / "nvidia-h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = headline._memory_first(cite.Figures(), tmp_path)
    assert "`lowmem` (recompute='all') at qwen3-8b 8192 on the H200: 750.0 ms, 0.90× against the fastest other (Unsloth; stock + compile, Liger-Kernel not run)" in text
    assert "peak 17.65 GiB against the lowest other's 17.38 GiB (Unsloth;" in text, text  # not unsloth-nockpt's 50.55


def test_a_speedup_whose_spreads_overlap_is_marked():
    # 258.8 [255.8–264.8] against 254.3 [246.3–263.2]: 1.01×, and the run cannot tell the two apart
    from harness.report import fmt

    tie = _point(stock=(909.5, 97.1), unsloth=(258.8, 95.7), user=(254.3, 103.9))
    tie.rows["unsloth"]["step_ms"].update(p20=255.8, p80=264.8)
    tie.rows["user"]["step_ms"].update(p20=246.3, p80=263.2)
    assert _ratio_cell(tie) == f"1.01× (Unsloth, 2 of 4 peers run) {fmt.OVERLAP}"
    tie.rows["user"]["step_ms"].update(p80=255.7)  # just below the peer's p20: apart
    assert _ratio_cell(tie) == "1.01× (Unsloth, 2 of 4 peers run)"
    assert not fmt.spreads_overlap(tie.rows["user"], {"step_ms": {"p50": 250.0}})  # a spread unknown: no claim


def _cells(p):
    head, _, row = headline._table(cite.Figures(), [p], other_code(list(p.rows.values()))).splitlines()
    return dict(zip(head.strip("|").split(" | "), (c.strip() for c in row.strip("|").split(" | "))))


def test_ours_at_its_best_is_a_column_named_by_its_variant_or_the_defaults():
    # the sixth role beside the five: a setting beyond the defaults shows its step and its name
    p = _point(stock=(540.5, 52.6), unsloth=(325.5, 58.2), user=(165.3, 56.2))
    p.rows["user"].update(role="user", stack="user")
    p.rows["best"] = dict(_row("ours-graph", 120.4, 56.3), point_id="p-graph", role="ours", stack="user")
    f = cite.Figures()
    head, _, row = headline._table(f, [p], other_code(list(p.rows.values()))).splitlines()
    assert dict(zip(head.strip("|").split(" | "), (c.strip() for c in row.strip("|").split(" | "))))[
        "ours, best setting"] == "120.4 ms (`ours-graph`)"
    assert any(k.startswith("120.4 ms = ms user/nvidia-h200/p-graph@") for k in cite.keys_comment(f).splitlines())
    assert _cells(p)["enable() against the fastest other"].startswith("1.96× (Unsloth")  # the ratio stays the one call's
    # the defaults were fastest: said so, even where best's row is another run's repeat of the user's variant
    p.rows["best"] = dict(p.rows["user"], recorded_at="2026-11-22T10:00:00+00:00")
    assert _cells(p)["ours, best setting"] == "the defaults"
    del p.rows["best"]
    assert _cells(p)["ours, best setting"] == "–"
    p.failed["best"] = "oom"
    assert _cells(p)["ours, best setting"] == "oom"
