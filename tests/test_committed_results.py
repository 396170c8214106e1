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
