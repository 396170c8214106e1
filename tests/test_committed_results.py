"""What the README and the committed results claim holds: each headline figure is written from, and
keyed to, one row's statistic; no doc cites a figure otherwise; each row keeps the experiment file it
ran from; the committed gate runs show what the gate claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.report import cite, headline

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))


def test_every_readme_figure_is_keyed_to_the_row_statistic_that_gives_it():
    """The headline block is what `python -m harness report` writes from the rows now, each figure's
    key reads back to that figure, and nothing outside the block cites a measured figure."""
    text = (ROOT / "README.md").read_text()
    assert len(cite.FIGURE.findall(text[text.index(headline.BEGIN):text.index(headline.END)])) >= 30
    assert headline.problems(text, ROOT / "results") == []


def test_the_blogs_one_call_figures_are_keyed_to_the_rows_that_give_them():
    """reports/README.md is what the code writes from the rows (tests/test_report_snapshots.py); its
    TL;DR's line for the one call also keys each figure to its row, and those keys read back."""
    text = (ROOT / "reports" / "README.md").read_text()
    tldr = text[text.index("## TL;DR"):text.index("\n## ", text.index("## TL;DR") + 3)]
    line = next(row for row in tldr.splitlines() if row.startswith("| `optim.enable(model)`, all of it"))
    assert len(cite.FIGURE.findall(line)) >= 20
    keys = tldr[tldr.index(cite.KEYS):]
    assert cite.check_keys(line + "\n" + keys, ROOT / "results") == []


@pytest.mark.parametrize("doc", DOCS)
def test_no_doc_cites_a_measured_figure_outside_a_block_written_from_rows(doc):
    assert headline.loose_figures((ROOT / doc).read_text()) == [], \
        f"{doc} cites measured figures: write them from rows (harness/report/headline.py) or cite the report"


def _edit_block(text: str, old: str, new: str) -> str:
    a, b = text.index(headline.BEGIN), text.index(headline.END)
    block = text[a:b]
    assert old in block
    return text[:a] + block.replace(old, new, 1) + text[b:]


def test_a_hand_typed_stale_or_unkeyed_figure_in_the_readme_is_caught():
    text = (ROOT / "README.md").read_text()
    results = ROOT / "results"
    shown, key = next(line.split(" = ", 1) for line in text.split(cite.KEYS)[1].splitlines()
                      if line.endswith("step_ms.p50") and line.split(" = ", 1)[1].startswith("ms "))
    value = float(shown.split()[0])
    typo = f"{value + 0.1:.1f} ms"
    # the figure typed by hand in the table and its key alike: the row still gives the old one
    edited = _edit_block(text, f"{shown} = {key}", f"{typo} = {key}").replace(f"| {shown} |", f"| {typo} |", 1)
    assert any(f"README shows {typo} where its row gives {shown}" in p for p in headline.problems(edited, results))
    # a figure in the table with no key
    edited = _edit_block(text, f"| {shown} |", f"| {shown} (was 236.5 ms) |")
    assert any("no key" in p and "236.5 ms" in p for p in headline.problems(edited, results))
    # a key to a row no longer current (another recording time: a re-measured or stale row)
    stale = key.replace("@20", "@19", 1)
    edited = _edit_block(text, f"{shown} = {key}", f"{shown} = {stale}")
    assert any("0 current rows" in p for p in headline.problems(edited, results))
    # a figure typed outside the block
    edited = text.replace("## Run a sweep, a report, a gate", "Ours took 236.5 ms.\n\n## Run a sweep, a report, a gate")
    assert any("outside the headline block" in p and "236.5 ms" in p for p in headline.problems(edited, results))
    edited = text.replace("## Run a sweep, a report, a gate", "It holds 120.9 KiB a token.\n\n## Run a sweep, a report, a gate")
    assert any("outside the headline block" in p and "120.9 KiB" in p for p in headline.problems(edited, results))
    # the block as the rows gave it once, before a row changed: not what the code writes now
    edited = _edit_block(text, "What `optim.enable(model)` gives", "What `optim.enable()` gives")
    assert any("not what the rows give now" in p for p in headline.problems(edited, results))
    assert "one of each" in headline.problems(text.replace(headline.END, ""), results)[0]


def _row(exp, variant, role, p50, when, code="c1", gib=2.0):
    return {"kind": "step", "status": "ok", "experiment": exp, "variant": variant, "role": role,
            "baseline_variant": "stock", "stack": {"liger": "liger", "user": "user"}.get(variant),
            "gpu_slug": "gpu-x", "device_name": "NVIDIA H100 80GB HBM3", "model": "m", "seq_len": 2048,
            "lora_rank": 16, "point_id": f"{variant}-pt", "recorded_at": f"2026-01-01T{when}:00+00:00",
            "step_ms": {"p20": p50, "p50": p50, "p80": p50}, "peak_allocated_gib": gib,
            "env": {"code_sha": code, "git_sha": code * 4}}


def test_report_writes_the_block_and_a_newer_measurement_makes_the_old_figures_stale(tmp_path):
    from harness import cli

    results = tmp_path / "results"
    (results / "user").mkdir(parents=True)
    rows = [_row("user", "stock", "stock", 800.0, "10:00", gib=9.0), _row("user", "liger", "peer", 600.0, "10:01"),
            _row("user", "user", "user", 200.0, "10:02", gib=2.5)]
    path = results / "user" / "gpu-x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline.BEGIN}\n{headline.END}\n\nThe rest.\n")
    assert cli.main(["report", "--results", str(results), "--reports", str(tmp_path / "reports")]) == 0
    text = readme.read_text()
    assert "| H100 | m, LoRA r=16, 2048 tokens | 800.0 ms | not run | 600.0 ms | not run | 200.0 ms | the defaults | 3.00× (Liger-Kernel, 2 of 4 peers run) " \
           "| 2.50 GiB / 2.00 GiB | `c1c1c1c` |" in text and text.endswith("\n\nThe rest.\n")
    assert headline.problems(text, results) == []
    # the user's path measured again by newer code: the README's figure is now stale
    rows.append(_row("user", "user", "user", 150.0, "11:00", code="c2"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = headline.problems(text, results)
    assert any("0 current rows" in p for p in found) and any("not what the rows give now" in p for p in found)
    assert cli.main(["report", "--results", str(results), "--reports", str(tmp_path / "reports")]) == 0
    assert "| 150.0 ms † |" in readme.read_text() and headline.problems(readme.read_text(), results) == []  # † another run


def test_a_variant_held_to_a_memory_target_gets_its_sentence_beside_the_peers_of_its_run(tmp_path):
    """The experiment kept beside the rows names the memory-first variant (a target with a variant
    and max_peak_over_lowest): the block says its settings, its step against the fastest other and
    its peak against the lowest other's, every figure keyed to its row."""
    import shutil

    from harness import cli

    results = tmp_path / "results"
    (results / "user" / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "user.toml", results / "user" / "experiments" / "kept.toml")
    rows = [_row("user", "stock", "stock", 800.0, "10:00", gib=9.0), _row("user", "liger", "peer", 600.0, "10:01"),
            _row("user", "user", "user", 200.0, "10:02", gib=2.5),
            {**_row("user", "user-lowmem-mlp-chunk", "ablation", 300.0, "10:03", gib=1.5), "stack": "user",
             "switches": {"recompute": "all", "offload": "double", "mlp_chunk": 2048, "gradient_checkpointing": True}}]
    for r in rows:
        r.update(model="qwen3-8b", seq_len=8192)
    (results / "user" / "gpu-x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline.BEGIN}\n{headline.END}\n")
    assert cli.main(["report", "--results", str(results), "--reports", str(tmp_path / "reports")]) == 0
    text = readme.read_text()
    assert ("`user-lowmem-mlp-chunk` (recompute='all', offload='double', mlp_chunk=2048) at qwen3-8b 8192 on the H100: "
            "300.0 ms, 2.00× against the fastest other (Liger-Kernel; stock + compile, Unsloth not run), "
            "peak 1.50 GiB against the lowest other's 2.00 GiB (Liger-Kernel; stock + compile, Unsloth not run)") in text
    assert headline.problems(text, results) == []


def test_a_readme_with_a_broken_block_gets_one_error_and_keeps_its_text(tmp_path, capsys):
    from harness import cli

    (tmp_path / "results").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline.END}\n{headline.BEGIN}\n")
    assert cli.main(["report", "--results", str(tmp_path / "results"), "--reports", str(tmp_path / "reports")]) == 2
    assert "one of each, in that order" in capsys.readouterr().err
    assert readme.read_text() == f"# x\n\n{headline.END}\n{headline.BEGIN}\n"


def test_every_committed_row_keeps_the_experiment_file_it_ran_from():
    """A row names its experiment file by hash; reports read the file's [report] targets from the kept
    copy, so a row whose copy is missing would be judged against an older file's targets."""
    missing = set()
    for path in (ROOT / "results").glob("*/*.jsonl"):
        kept = path.parent / "experiments"
        for line in path.read_text().splitlines():
            sha = str(json.loads(line).get("experiment_sha256") or "")[:16] if line.strip() else ""
            if sha and not (kept / f"{sha}.toml").is_file():
                missing.add(f"{path.parent.name}/experiments/{sha}.toml")
    assert not missing, f"rows name experiment files results/ does not keep: {sorted(missing)}"


def _gate_run(name: str) -> dict:
    return json.loads((ROOT / "results" / "gate" / name / "gate.json").read_text())


def test_the_committed_a_a_run_is_of_the_suite_as_it_is_and_resolves_five_percent():
    """results/gate/a-a-4 ran experiments/gate.toml as it is now (an edited suite needs a new A/A
    run), head against itself: it passed, and every judged point's 99 % interval holds 1.0 with a
    half-width of at most 5 %, the slowdown the gate judges."""
    run = _gate_run("a-a-4")
    assert (ROOT / "results/gate/a-a-4/suite.toml").read_bytes() == (ROOT / "experiments/gate.toml").read_bytes()
    assert run["base"]["sha"] == run["head"]["sha"] and run["outcome"] == "pass"
    judged = {p["label"]: p["time"] for p in run["points"]}
    assert {label.split()[-1] for label in judged} == {"user", "moe-graph"}
    assert sum(label.endswith(" user") for label in judged) == 3  # one user point per family
    for label, t in judged.items():
        assert t["low"] <= 1.0 <= t["high"], label
        assert (t["high"] - t["low"]) / 2 <= 0.05, (label, t)


def test_the_replanted_user_path_regression_fails_the_gate_naming_each_user_point():
    run = _gate_run("planted-recompute-all")
    assert run["outcome"] == "fail" and run["exit_code"] == 1
    failed = [p for p in run["points"] if p["outcome"] == "fail" and p["verdict"] == "SLOWER"]
    assert sorted(p["model"] for p in failed) == ["gpt-oss-20b-2l", "qwen3-30b-a3b-2l", "qwen3-8b-4l"]
    assert all(p["variant"] == "user" and p["time"]["low"] > 1.05 for p in failed)
