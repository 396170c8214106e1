"""Regression gate: a candidate's result rows against a baseline's, point by point, for CI.

Reads only result files (see harness/results.py). A point is identified by what it measures,
without its repeat; its repeats collapse to the median of their per-run step-time p50. The gate
fails on a step-time slowdown beyond a threshold (widened to the observed noise with
``noise="auto"``), on peak-memory growth beyond a threshold, and on a point that was ok in the
baseline but oom/error in the candidate. A point on one side only is a warning.

Exit codes, as ``python -m harness gate`` returns them: 0 pass (warnings allowed), 1 regression,
2 unusable input (raised here as ``GateError``).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import results as res
from harness.errors import InputError
from harness.row import IDENTITY, STATUSES, match_key

NOISE_MODES = ("auto", "off")


class GateError(InputError):
    """Input the gate cannot judge: a missing, corrupt or empty results file, or mismatched GPUs."""


def parse_fraction(text: str) -> float:
    """``"5%"`` → 0.05, ``"0.05"`` → 0.05. A bare number of 1 or more is refused as ambiguous."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a percentage (write e.g. 5% or 0.05)") from None
    if not s.endswith("%") and value >= 1:
        raise ValueError(f"{text!r} is ambiguous: write {s}% or {value / 100:g}")
    if value < 0 or value != value:
        raise ValueError(f"{text!r} must be a non-negative percentage")
    return value


# ---------------------------------------------------------------------------------------------
# Loading


def result_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
        if not files:
            raise GateError(f"{path}: no .jsonl result files in this directory")
        return files
    if not path.exists():
        raise GateError(f"{path}: file not found")
    return [path]


def load_step_rows(path: str | Path) -> tuple[list[Path], list[dict]]:
    """The step rows of a results file, or of every ``*.jsonl`` under a directory, each tagged
    with the file it came from (``_file``). Bandwidth rows measure the machine, not the code,
    and are skipped."""
    files = result_files(path)
    rows = []
    for f in files:
        try:
            file_rows = res.read_rows(f)
        except UnicodeDecodeError as e:
            raise GateError(f"{f}: not a text results file ({e.reason})") from None
        except ValueError as e:  # a corrupt line; the message names the file and line
            raise GateError(str(e)) from None
        except OSError as e:
            raise GateError(f"{f}: cannot read ({e.strerror})") from None
        for i, row in enumerate(file_rows, 1):
            if not isinstance(row, dict):
                raise GateError(f"{f}: row {i}: not a result row (a JSON {type(row).__name__}, expected an object)")
            if row.get("kind") == "step":
                check_row(f, i, row)
                rows.append({**row, "_file": str(f)})
    if not rows:
        where = f"{path}: no step rows in {len(files)} .jsonl file(s)" if len(files) > 1 else f"{files[0]}: no step rows"
        raise GateError(f"{where} (expected rows written by `python -m harness sweep`)")
    return files, rows


def check_row(path: Path, i: int, row: dict) -> None:
    for key in ("model", "seq_len", "variant", "status"):
        if row.get(key) is None:
            raise GateError(f"{path}: row {i}: step row without {key!r}")
    if row["status"] not in STATUSES:
        raise GateError(f"{path}: row {i}: unknown status {row['status']!r} (valid: {', '.join(STATUSES)})")
    if row["status"] == "ok":
        p50 = (row.get("step_ms") or {}).get("p50")
        if isinstance(p50, bool) or not isinstance(p50, (int, float)) or not 0 < p50 < float("inf"):
            raise GateError(f"{path}: row {i}: ok row without a positive step_ms.p50 (got {p50!r})")


def device_name(row: dict) -> str:
    return row.get("device_name") or (row.get("env") or {}).get("device_name") or "unknown"


def identity(row: dict) -> str:
    """What a point measures, without its repeat (``harness.row.match_key``)."""
    return match_key(row)


# ---------------------------------------------------------------------------------------------
# One point, one side


@dataclass
class Side:
    """A point's repeats on one side of the comparison, collapsed."""

    status: str  # "ok" only when every repeat is ok; otherwise the worst of them
    message: str
    repeats: int
    step_ms_p50: float | None  # median over repeats of each run's p50
    step_spread: float | None  # median over repeats of each run's p80/p20 - 1
    repeat_spread: float | None  # max/min - 1 of the per-run p50s; None with one repeat
    peak_allocated_gib: float | None  # median over repeats; None on CPU

    @classmethod
    def of(cls, rows: list[dict]) -> "Side":
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            worst = next((r for r in bad if r["status"] == "oom"), bad[0])
            return cls(worst["status"], str(worst.get("message") or "")[:200], len(rows), None, None, None, None)
        p50s = [float(r["step_ms"]["p50"]) for r in rows]
        spreads = [r["step_ms"]["p80"] / r["step_ms"]["p20"] - 1 for r in rows
                   if _positive(r["step_ms"].get("p20")) and _positive(r["step_ms"].get("p80"))]
        mems = [float(r["peak_allocated_gib"]) for r in rows if _positive(r.get("peak_allocated_gib"))]
        return cls(
            status="ok", message="", repeats=len(rows),
            step_ms_p50=statistics.median(p50s),
            step_spread=statistics.median(spreads) if spreads else None,
            repeat_spread=max(p50s) / min(p50s) - 1 if len(p50s) > 1 else None,
            peak_allocated_gib=statistics.median(mems) if mems else None,
        )


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@dataclass
class PointResult:
    label: str
    identity: dict
    device_name: str | None  # None when --allow-different-gpu pairs two GPUs
    baseline: Side | None
    candidate: Side | None
    outcome: str = "pass"  # "pass" | "fail" | "warn"
    verdict: str = "ok"
    ratio: float | None = None  # candidate / baseline step ms
    allowed_slowdown: float | None = None
    bound: str | None = None  # which bound set allowed_slowdown
    memory_growth: float | None = None
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def judge(point: PointResult, max_slowdown: float, max_memory_growth: float, noise: str) -> PointResult:
    base, cand = point.baseline, point.candidate
    if base is None or cand is None:
        point.outcome, point.verdict = "warn", f"missing in {'baseline' if base is None else 'candidate'}"
        return point
    if base.status != "ok":
        point.verdict = f"fixed (was {base.status})" if cand.status == "ok" else f"{base.status} → {cand.status}"
        return point
    if cand.status == "skipped":  # a peer missing on the candidate's machine is not our regression
        point.outcome, point.verdict = "warn", "skipped in the candidate"
        point.reasons.append(f"skipped in the candidate: {cand.message}")
        return point
    if cand.status != "ok":
        point.outcome, point.verdict = "fail", f"ok → {cand.status}"
        detail = f": {cand.message}" if cand.message else ""
        point.reasons.append(f"ok in the baseline, {cand.status} in the candidate{detail}")
        return point

    point.ratio = cand.step_ms_p50 / base.step_ms_p50
    point.allowed_slowdown, point.bound = max_slowdown, "threshold"
    if noise == "auto":
        observed = [("noise: base p80/p20", base.step_spread), ("noise: cand p80/p20", cand.step_spread),
                    ("noise: base repeats", base.repeat_spread), ("noise: cand repeats", cand.repeat_spread)]
        name, spread = max(((n, s) for n, s in observed if s is not None), key=lambda x: x[1], default=("", None))
        if spread is not None and spread > max_slowdown:
            point.allowed_slowdown, point.bound = spread, name
    slower = point.ratio - 1 > point.allowed_slowdown
    if slower:
        point.reasons.append(f"step time +{point.ratio - 1:.1%} > allowed +{point.allowed_slowdown:.1%} ({point.bound})")

    if base.peak_allocated_gib and cand.peak_allocated_gib:
        point.memory_growth = cand.peak_allocated_gib / base.peak_allocated_gib - 1
    grew = point.memory_growth is not None and point.memory_growth > max_memory_growth
    if grew:
        point.reasons.append(f"peak memory {base.peak_allocated_gib:.2f} → {cand.peak_allocated_gib:.2f} GiB "
                             f"(+{point.memory_growth:.1%} > +{max_memory_growth:.1%})")

    if slower or grew:
        point.outcome = "fail"
        point.verdict = "+".join(v for v, hit in (("SLOWER", slower), ("MEMORY", grew)) if hit)
    elif point.ratio - 1 < -point.allowed_slowdown:
        point.verdict = "faster"
    return point


# ---------------------------------------------------------------------------------------------
# Both sides


@dataclass
class GateResult:
    points: list[PointResult]
    baseline_files: list[str]
    candidate_files: list[str]
    baseline_devices: list[str]
    candidate_devices: list[str]
    baseline_git: list[str]
    candidate_git: list[str]
    max_slowdown: float
    max_memory_growth: float
    noise: str

    @property
    def failed(self) -> list[PointResult]:
        return [p for p in self.points if p.outcome == "fail"]

    @property
    def warned(self) -> list[PointResult]:
        return [p for p in self.points if p.outcome == "warn"]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def summary(self) -> str:
        compared = sum(p.baseline is not None and p.candidate is not None for p in self.points)
        kinds = {}
        for p in self.failed:
            kinds[p.verdict] = kinds.get(p.verdict, 0) + 1
        faster = sum(p.verdict == "faster" for p in self.points)
        head = "gate: FAIL" if self.failed else "gate: PASS"
        text = f"{head}: {len(self.failed)} of {compared} points regressed"
        if kinds:
            text += " (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"
        if faster:
            text += f", {faster} faster"
        if self.warned:
            text += f"; warning: {len(self.warned)} missing or skipped on one side"
        return (text + f"; max slowdown {self.max_slowdown:.1%}, max memory growth "
                f"{self.max_memory_growth:.1%}, noise {self.noise}")

    def table(self) -> str:
        header = ["point", "base ms", "cand ms", "ratio", "allowed", "bound", "mem", "verdict"]
        body = []
        for p in self.points:
            b, c = p.baseline, p.candidate
            body.append([
                p.label,
                _ms(b), _ms(c),
                f"{p.ratio:.3f}" if p.ratio is not None else "-",
                f"+{p.allowed_slowdown:.1%}" if p.allowed_slowdown is not None else "-",
                p.bound or "-",
                f"{p.memory_growth:+.1%}" if p.memory_growth is not None else "-",
                p.verdict if p.outcome != "fail" else f"FAIL {p.verdict}",
            ])
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        right = {1, 2, 3, 4, 6}
        lines = ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                           for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                 for row in [header, *body]]
        return "\n".join(lines)

    def header(self) -> str:
        def side(files, devices, shas):
            git = f", git {', '.join(s[:10] for s in shas)}" if shas else ""
            return f"{', '.join(files)} ({', '.join(devices)}{git})"

        return (f"baseline:  {side(self.baseline_files, self.baseline_devices, self.baseline_git)}\n"
                f"candidate: {side(self.candidate_files, self.candidate_devices, self.candidate_git)}")

    def to_dict(self) -> dict:
        return {
            "outcome": "fail" if self.failed else "pass",
            "exit_code": self.exit_code,
            "summary": self.summary(),
            "max_slowdown": self.max_slowdown,
            "max_memory_growth": self.max_memory_growth,
            "noise": self.noise,
            "baseline": {"files": self.baseline_files, "device_names": self.baseline_devices, "git_sha": self.baseline_git},
            "candidate": {"files": self.candidate_files, "device_names": self.candidate_devices, "git_sha": self.candidate_git},
            "counts": {
                "points": len(self.points),
                "failed": len(self.failed),
                "missing": len(self.warned),
                "faster": sum(p.verdict == "faster" for p in self.points),
            },
            "points": [p.to_dict() for p in self.points],
        }


def _ms(side: Side | None) -> str:
    if side is None:
        return "-"
    return f"{side.step_ms_p50:.1f}" if side.status == "ok" else side.status


def _group(rows: list[dict], by_device: bool, where: str) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    seen: dict[tuple, str] = {}
    for row in rows:
        key = (device_name(row) if by_device else "", identity(row))
        rep = (*key, row.get("repeat"))
        if rep in seen:
            raise GateError(f"{where}: repeat {row.get('repeat')} of {_label(row)} appears twice "
                            f"({seen[rep]} and {row['_file']}); point at one results file per run")
        seen[rep] = row["_file"]
        groups.setdefault(key, []).append(row)
    return groups


def _label(row: dict) -> str:
    return f"{row.get('model')} T={row.get('seq_len')} bs={row.get('batch_size')} {row.get('variant')}"


def compare(baseline_rows: list[dict], candidate_rows: list[dict], *, max_slowdown: float = 0.05,
            max_memory_growth: float = 0.05, noise: str = "auto", allow_different_gpu: bool = False,
            baseline_where: str = "baseline", candidate_where: str = "candidate") -> list[PointResult]:
    """Pair step rows by (device, identity) and judge each pair. Rows need a ``_file`` key."""
    if noise not in NOISE_MODES:
        raise GateError(f"noise mode {noise!r} is not valid (valid: {', '.join(NOISE_MODES)})")
    base_devices = sorted({device_name(r) for r in baseline_rows})
    cand_devices = sorted({device_name(r) for r in candidate_rows})
    by_device = base_devices == cand_devices
    if not by_device:
        if not allow_different_gpu:
            raise GateError(
                f"different GPUs: {baseline_where} ran on {', '.join(base_devices)}, {candidate_where} on "
                f"{', '.join(cand_devices)}; step times from different GPUs are not comparable. Point "
                f"--baseline at the results file of the candidate's GPU, or pass --allow-different-gpu")
        for where, devices in ((baseline_where, base_devices), (candidate_where, cand_devices)):
            if len(devices) > 1:
                raise GateError(f"{where}: holds rows of several GPUs ({', '.join(devices)}); "
                                f"--allow-different-gpu compares one GPU with one other, so point at one file")

    base = _group(baseline_rows, by_device, baseline_where)
    cand = _group(candidate_rows, by_device, candidate_where)
    keys = list(base) + [k for k in cand if k not in base]
    if not any(k in cand for k in base):
        raise GateError(
            f"no point of {candidate_where} matches one of {baseline_where}: a point is matched on "
            f"{', '.join(IDENTITY)}{' and the GPU' if by_device else ''}; were both sides run "
            f"from the same experiment file?")

    first = {k: (base.get(k) or cand.get(k))[0] for k in keys}
    experiments = {first[k].get("experiment") for k in keys}
    devices = {k[0] for k in keys}
    labels = {}
    for k in keys:
        label = _label(first[k])
        if len(experiments) > 1:
            label = f"{first[k].get('experiment')}: {label}"
        if len(devices) > 1:
            label += f" [{k[0]}]"
        labels[k] = label
    counts = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    for k, label in labels.items():
        if counts[label] > 1:  # same model/length/variant with another lora_rank, dtype, ...
            labels[k] = f"{label} #{hashlib.sha256(k[1].encode()).hexdigest()[:6]}"

    points = []
    for k in keys:
        point = PointResult(
            label=labels[k], identity=json.loads(k[1]), device_name=k[0] or None,
            baseline=Side.of(base[k]) if k in base else None,
            candidate=Side.of(cand[k]) if k in cand else None,
        )
        points.append(judge(point, max_slowdown, max_memory_growth, noise))
    return points


def _git_shas(rows: list[dict]) -> list[str]:
    shas = []
    for r in rows:
        sha = (r.get("env") or {}).get("git_sha")
        if sha and sha not in shas:
            shas.append(sha)
    return shas


def run(baseline: str | Path, candidate: str | Path, *, max_slowdown: float = 0.05,
        max_memory_growth: float = 0.05, noise: str = "auto", allow_different_gpu: bool = False) -> GateResult:
    """Load both sides and compare them. Raises ``GateError`` on input it cannot judge."""
    base_files, base_rows = load_step_rows(baseline)
    cand_files, cand_rows = load_step_rows(candidate)
    points = compare(base_rows, cand_rows, max_slowdown=max_slowdown, max_memory_growth=max_memory_growth,
                     noise=noise, allow_different_gpu=allow_different_gpu,
                     baseline_where=str(baseline), candidate_where=str(candidate))
    return GateResult(
        points=points,
        baseline_files=[str(f) for f in base_files], candidate_files=[str(f) for f in cand_files],
        baseline_devices=sorted({device_name(r) for r in base_rows}),
        candidate_devices=sorted({device_name(r) for r in cand_rows}),
        baseline_git=_git_shas(base_rows), candidate_git=_git_shas(cand_rows),
        max_slowdown=max_slowdown, max_memory_growth=max_memory_growth, noise=noise,
    )
