"""What an experiment's report compares and judges: the ``[report.<section>]`` tables of the
experiment file kept under ``results/<experiment>/experiments/``, so a report needs nothing but
``results/``."""

from __future__ import annotations

from pathlib import Path

from harness.run import experiment as experiment_file


def kept_file(results_root: Path | str, experiment: str, rows: list[dict]) -> Path | None:
    """The kept experiment file the newest row that names one (by ``experiment_sha256``) ran
    from; with no such row, the only kept file; else None."""
    kept = {p.stem: p for p in sorted((Path(results_root) / experiment / "experiments").glob("*.toml"))}
    for r in sorted(rows, key=lambda r: str(r.get("recorded_at") or ""), reverse=True):
        if (sha := str(r.get("experiment_sha256") or "")[:16]) in kept:
            return kept[sha]
    return next(iter(kept.values())) if len(kept) == 1 else None


def load(results_root: Path | str, experiment: str, rows: list[dict]) -> tuple[dict, Path | None]:
    """(``{section: table}``, the file it came from); ``({}, None)`` when no kept file applies. A
    kept file that no longer parses raises ``ExperimentError`` naming it."""
    path = kept_file(results_root, experiment, rows)
    if path is None:
        return {}, None
    return experiment_file.load(path).report, path
