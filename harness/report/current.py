"""Which rows a report reads: those of the experiment file as it is now, and per point only the
newest code's. The rest are stale: listed in the report's appendix, never averaged in.

"The file as it is now" is the kept copy the newest row ran from (``spec.kept_file``). A step row
belongs to it when that file still defines its point alike: the same model, length, variant and
repeat, with an equal point identity (``harness.row.point_id``, under the row's own ``OPTIM_*``
variables). A probe of ``harness context`` belongs to it too: the file's model and variant at the
probe's length and step counts, with an equal identity. A variant or length dropped from the file, or a variant whose switches changed, leaves
its older rows stale; a row that names no experiment file (``experiment_sha256``) is read as it is. Of a point's rows, those of the code that measured its newest row stay
(``runs.newest_code``), on each GPU type: the others are that older code's results, not repeats.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from harness import row as rowmod
from harness.report import fmt, runs, spec
from harness.run import experiment as experiment_file

FILE_CHANGED = "the experiment file as it is now defines this point otherwise, or not at all"
OLDER_CODE = "older code than the point's newest row"


@dataclass
class Split:
    rows: list[dict]  # what the report reads
    stale: list[tuple[dict, str]] = field(default_factory=list)  # (row, why)
    kept: Path | None = None  # the experiment file as it is now


def _point_ids(path: Path) -> tuple[dict[tuple, object], object]:
    exp = experiment_file.load(path)
    return {(p.model, p.seq_len, p.variant, p.gpus, p.repeat): p for p in exp.points()}, exp


def _probe(exp, r: dict):
    """The point ``harness context`` ran for row ``r`` from this file (its model and variant at the
    row's length and step counts), or None where the file has no such model or variant."""
    if r.get("model") not in exp.models or r.get("variant") not in exp.variants:
        return None
    one = dataclasses.replace(experiment_file.subset(exp, models=[r["model"]], variants=[r["variant"]]),
                              seq_lens=[int(r["seq_len"])], warmup_steps=int(r.get("warmup_steps") or 0),
                              measured_steps=int(r.get("measured_steps") or 0))
    return next((p for p in one.points() if (p.gpus, p.repeat) == (int(r.get("gpus") or 1), int(r.get("repeat") or 0))),
                None)


def split(results_root: Path | str, experiment: str, rows: list[dict]) -> Split:
    """``rows`` (of one experiment) parted into those the report reads and the stale ones. Rows
    other than step rows (bandwidth, benchmarks) are all read."""
    kept = spec.kept_file(results_root, experiment, rows)
    points, exp = _point_ids(kept) if kept is not None else (None, None)
    out = Split(rows=[], kept=kept)
    by_point: dict[str, list[dict]] = {}  # per GPU type and point
    for r in rows:
        if r.get("kind") != "step":
            out.rows.append(r)
            continue
        if points is not None and r.get("experiment_sha256"):  # a row that names no file cannot be placed
            key = (r.get("model"), r.get("seq_len"), r.get("variant"), int(r.get("gpus") or 1), int(r.get("repeat") or 0))
            same = [p for p in (points.get(key), _probe(exp, r)) if p is not None
                    and rowmod.point_id({**dataclasses.asdict(p), "env_switches": r.get("env_switches") or {}})
                    == r.get("point_id")]
            if not same:
                out.stale.append((r, FILE_CHANGED))
                continue
        by_point.setdefault(f"{r.get('gpu_slug')}/{r.get('point_id')}", []).append(r)  # a GPU type's own
    newest = {id(r) for group in by_point.values() for r in runs.newest_code(group)}
    changed = {id(r) for r, _ in out.stale}
    for r in rows:  # in the file's order, as read
        if r.get("kind") == "step" and id(r) not in changed:
            (out.rows.append(r) if id(r) in newest else out.stale.append((r, OLDER_CODE)))
    return out


def appendix(parts: Split, experiment: str) -> str:
    """``## Appendix: stale rows``, one line per stale step row ("" when there is none)."""
    if not parts.stale:
        return ""
    body = []
    for r, why in sorted(parts.stale, key=lambda x: (str(x[0].get("gpu_slug")), str(x[0].get("model")),
                                                       int(x[0].get("seq_len") or 0), str(x[0].get("variant")),
                                                       str(x[0].get("recorded_at")))):
        step = (r.get("step_ms") or {}).get("p50")
        body.append([r.get("gpu_slug") or "unknown", r.get("model"), r.get("seq_len"), r.get("variant"),
                     r.get("repeat", 0), r.get("status"), fmt.num(step, ".1f") if step is not None else "–",
                     str((r.get("env") or {}).get("git_sha") or "?")[:8], str(r.get("recorded_at") or "?")[:16], why])
    name = f"`results/{experiment}/experiments/{parts.kept.name}`" if parts.kept else "the experiment file"
    return ("## Appendix: stale rows\n\n"
            f"Rows under `results/{experiment}/` that no table, plot or target above reads: the experiment file as "
            f"it is now ({name}, the file the newest row ran from) defines their point otherwise or not at all, "
            "or a newer code measured their point since.\n\n"
            + fmt.table(["GPU", "model", "seq_len", "variant", "repeat", "status", "step ms p50", "git", "recorded",
                         "why stale"], body))
