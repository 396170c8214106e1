"""One rendered snapshot per report: every committed report is what the report code writes now from
the committed rows. The report tests assert on the computed data (``fmt.recording``); this is the
one place the wording is held, and regenerating the reports (``python -m harness report``) is
how a wording change lands."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_committed_report_is_what_the_code_writes_from_the_committed_rows(tmp_path):
    from harness import cli

    out = tmp_path / "reports"
    assert cli.main(["report", "--results", str(ROOT / "results"), "--reports", str(out)]) == 0
    committed = sorted(p.relative_to(ROOT / "reports") for p in (ROOT / "reports").rglob("*.md"))
    written = sorted(p.relative_to(out) for p in out.rglob("*.md"))
    assert written == committed
    stale = [str(p) for p in committed if (out / p).read_text() != (ROOT / "reports" / p).read_text()]
    assert not stale, f"reports that differ from what the code writes now (run python -m harness report): {stale}"
