"""What the README and the committed results claim holds: each headline figure is a value some row
holds, and each row keeps the experiment file it ran from."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(\d+\.\d+) (?:ms|GiB)\b")


def _recorded(results: Path) -> set[str]:
    """Every number of every row, as the README would print it (one or two decimals), except single
    steps' samples: the README cites statistics, and thousands of samples would let a stale figure
    pass by matching one of them."""
    seen: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k != "samples":
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            seen.update((f"{x:.1f}", f"{x:.2f}"))

    for path in results.glob("*/*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                walk(json.loads(line))
    return seen


def _headline(readme: str) -> str:
    return readme[readme.index("## Headline results"):readme.index("\n## ", readme.index("## Headline results") + 3)]


def test_every_headline_figure_is_a_value_a_committed_row_holds():
    section = _headline((ROOT / "README.md").read_text())
    figures = FIGURE.findall(section)
    assert len(figures) >= 20  # the tables are there, and the pattern reads them
    recorded = _recorded(ROOT / "results")
    missing = sorted(set(f for f in figures if f not in recorded), key=float)
    assert not missing, f"README figures no row in results/ holds: {missing}"


def test_a_figure_no_row_holds_is_caught(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "gpu.jsonl").write_text(json.dumps({"step_ms": {"p50": 236.54, "samples": [494.5]}}) + "\n")
    recorded = _recorded(tmp_path)
    assert "236.5" in recorded and "236.6" not in recorded and "494.5" not in recorded
    readme = "# t\n\n## Headline results\n\n| a | 236.5 ms | 1.23 GiB |\n\n## Next\n\n999.9 ms\n"
    assert FIGURE.findall(_headline(readme)) == ["236.5", "1.23"]


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
