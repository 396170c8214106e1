"""Judging a revisions gate: each point's rounds on both sides, and each switch guard.

A point's value in a round is its step-time p50 (the median of that round's measured steps) and
its peak allocated memory. A point fails when, between base's rounds and head's:
  * step time changed significantly (Mann-Whitney U, p < alpha) and the Hodges-Lehmann ratio is
    slower than ``max_slowdown``;
  * peak memory changed significantly and grew by more than ``max_memory_mib``;
  * it ran ok in every base round and not in some head round (oom, error);
  * base measured it and head wrote no row of it (both sides swept the same suite).
A base that failed a minority of its rounds is judged on its ok rounds, and says so; memory is
judged on the rounds that recorded a peak, and a side without any says it was not judged.
Rows of head that match none of base's (the point identity changed between the two codes) are
no verdict at all: ``GateError``.
A guard fails when, in head's rounds, its ``on`` variant's speedup over ``off`` (Hodges-Lehmann
ratio of off/on) is below the floor recorded in the suite, or when its parity check failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.gate import stats
from harness.gate.files import GateError
from harness.row import match_key
from harness.run.gate_spec import GateSpec, Guard

MIB = 2**20


@dataclass
class SideRounds:
    """One point on one side: its value in each round."""

    status: str  # ok when every round was ok, else the first other status
    message: str
    step_ms: list[float]  # per ok round, the round's p50
    peak_mib: list[float]  # per ok round that recorded a peak; empty on CPU
    rounds: int = 0  # rounds that measured the point, ok or not


@dataclass
class PointVerdict:
    label: str
    model: str
    seq_len: int
    variant: str
    cuda_graph: bool
    base: SideRounds | None
    head: SideRounds | None
    time: stats.Shift | None = None  # head/base step-time ratio
    memory: stats.Shift | None = None  # head - base peak MiB
    outcome: str = "pass"  # pass | fail | warn
    verdict: str = "no change"
    reasons: list[str] = field(default_factory=list)


@dataclass
class GuardVerdict:
    guard: Guard
    head: stats.Shift | None  # off/on step-time ratio in head's rounds: the switch's speedup
    base: stats.Shift | None
    parity: dict | None
    ok: bool = True
    reasons: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        g = self.guard
        return f"{g.switch} ({g.model} T={g.seq_len}: {g.on} vs {g.off})"


def _collapse(rows_by_round: dict[int, list[dict]]) -> SideRounds:
    step, mem, worst = [], [], None
    for number in sorted(rows_by_round):
        rows = rows_by_round[number]
        bad = [r for r in rows if r.get("status") != "ok"]
        if bad:
            here = next((r for r in bad if r["status"] == "oom"), bad[0])
            worst = worst if worst is not None and worst["status"] == "oom" else here
            continue
        step.append(stats.median([float(r["step_ms"]["p50"]) for r in rows]))
        peaks = [float(r["peak_allocated_gib"]) * 1024 for r in rows if r.get("peak_allocated_gib")]
        if peaks:
            mem.append(stats.median(peaks))
    if worst is not None:
        return SideRounds(worst["status"], str(worst.get("message") or "")[:300], step, mem, len(rows_by_round))
    return SideRounds("ok", "", step, mem, len(rows_by_round))


def side_points(rows: list[dict]) -> dict[str, tuple[dict, SideRounds]]:
    """match key -> (a representative row, the point's rounds), for one side's rows."""
    grouped: dict[str, dict[int, list[dict]]] = {}
    first: dict[str, dict] = {}
    for r in rows:
        key = match_key(r)
        grouped.setdefault(key, {}).setdefault(r["_round"], []).append(r)
        first.setdefault(key, r)
    return {k: (first[k], _collapse(v)) for k, v in grouped.items()}


def judge_point(p: PointVerdict, spec: GateSpec) -> PointVerdict:
    base, head = p.base, p.head
    if head is None and base is not None:  # both swept one suite: head stopped measuring it
        p.outcome, p.verdict = "fail", "missing in head"
        p.reasons.append("base measured it; head wrote no row of it (the point no longer runs, or its identity changed)")
        return p
    if base is None:
        p.outcome, p.verdict = "warn", "only in head"
        return p
    notes = []
    if base.status != "ok":
        ok_rounds = len(base.step_ms)
        if head.status != "ok" or ok_rounds < 2 or 2 * ok_rounds < base.rounds:
            p.outcome = "warn"
            p.verdict = f"fixed (was {base.status})" if head.status == "ok" else f"{base.status} in both"
            return p
        # a flaky base round does not exempt the point: judged on base's ok rounds, and said
        notes.append(f"base {base.status} in {base.rounds - ok_rounds} of {base.rounds} rounds, judged on the other {ok_rounds}")
    if head.status == "skipped":
        p.outcome, p.verdict = "warn", "skipped in head"
        p.reasons.append(f"skipped in head: {head.message}")
        return p
    if head.status != "ok":
        p.outcome, p.verdict = "fail", f"ok -> {head.status}"
        p.reasons.append(f"ok in every base round, {head.status} in head: {head.message}")
        return p

    p.time = stats.shift(base.step_ms, head.step_ms, alpha=spec.alpha, log_ratio=True)
    significant = p.time.p < spec.alpha
    slower = significant and p.time.estimate - 1 > spec.max_slowdown
    faster = significant and 1 - p.time.estimate > spec.max_slowdown
    if slower:
        p.reasons.append(f"step time x{p.time.estimate:.3f} [{p.time.low:.3f}, {p.time.high:.3f}], "
                         f"p = {p.time.p:.2g} < {spec.alpha:g}, beyond +{spec.max_slowdown:.0%}")
    grew = less = False
    if bool(base.peak_mib) != bool(head.peak_mib):
        notes.append(f"memory not judged: {'head' if base.peak_mib else 'base'} recorded no peak")
    if len(base.peak_mib) >= 2 and len(head.peak_mib) >= 2:
        p.memory = stats.shift(base.peak_mib, head.peak_mib, alpha=spec.alpha)
        mem_sig = p.memory.p < spec.alpha
        grew = mem_sig and p.memory.estimate > spec.max_memory_mib
        less = mem_sig and -p.memory.estimate > spec.max_memory_mib
        if grew:
            p.reasons.append(f"peak memory {p.memory.estimate:+.0f} MiB [{p.memory.low:+.0f}, {p.memory.high:+.0f}], "
                             f"p = {p.memory.p:.2g} < {spec.alpha:g}, beyond +{spec.max_memory_mib:.0f} MiB")
    if slower or grew:
        p.outcome = "fail"
        p.verdict = "+".join(v for v, hit in (("SLOWER", slower), ("MEMORY", grew)) if hit)
    elif faster or less:
        p.verdict = " and ".join(v for v, hit in (("faster", faster), ("less memory", less)) if hit)
    elif significant:
        p.verdict = f"changed {p.time.estimate - 1:+.1%}, within {spec.max_slowdown:.0%}"
    if notes:
        p.verdict = "; ".join([p.verdict, *notes]) if p.verdict else "; ".join(notes)
        if p.outcome != "fail":
            p.outcome = "warn"
    return p


def judge_guard(g: Guard, base_points: dict, head_points: dict, parity: dict | None, spec: GateSpec) -> GuardVerdict:
    def speedup(points) -> tuple[stats.Shift | None, str]:
        sides = {}
        for which in ("on", "off"):
            match = [sr for row, sr in points.values()
                     if row["model"] == g.model and row["seq_len"] == g.seq_len and row["variant"] == getattr(g, which)]
            if not match:
                return None, f"variant {getattr(g, which)!r} has no rows"
            if match[0].status != "ok":
                return None, f"variant {getattr(g, which)!r} was {match[0].status}: {match[0].message}"
            sides[which] = match[0].step_ms
        return stats.shift(sides["on"], sides["off"], alpha=spec.alpha, log_ratio=True), ""

    head, why = speedup(head_points)
    base, _ = speedup(base_points)
    v = GuardVerdict(g, head, base, parity)
    if head is None:
        v.ok = False
        v.reasons.append(f"speedup not measured in head: {why}")
    elif head.estimate < g.min_speedup:
        v.ok = False
        v.reasons.append(f"speedup {head.estimate:.3f}x below its floor {g.min_speedup:g}x")
    if g.parity:
        if parity is None:
            v.ok = False
            v.reasons.append("parity not checked")
        elif not parity.get("ok"):
            v.ok = False
            v.reasons.append(f"parity failed: {parity.get('message')}")
    return v


def label(row: dict) -> str:
    return f"{row['model']} T={row['seq_len']} {row['variant']}"


def judge(base_rows: list[dict], head_rows: list[dict], spec: GateSpec, parity_rows: list[dict], *,
          guard_rows: list[dict] | None = None, base_guard_rows: list[dict] | None = None,
          ) -> tuple[list[PointVerdict], list[GuardVerdict]]:
    """Points from the judged rows; guards from ``guard_rows`` (head's rows of every variant;
    default ``head_rows``) and, where base ran them too, ``base_guard_rows``."""
    base_points, head_points = side_points(base_rows), side_points(head_rows)
    if base_points and head_points and not set(base_points) & set(head_points):
        raise GateError(f"none of head's {len(head_points)} points matches one of base's {len(base_points)}: the "
                        "fields that name a point (harness.row.match_key: data, switches, lora_dtype, ...) "
                        "changed between the two codes, so nothing can be compared; gate that change by hand")
    head_all = side_points(guard_rows) if guard_rows is not None else head_points
    base_all = side_points(base_guard_rows) if base_guard_rows is not None else base_points
    points = []
    for key in [*base_points, *(k for k in head_points if k not in base_points)]:
        row = (base_points.get(key) or head_points[key])[0]
        points.append(judge_point(PointVerdict(
            label=label(row), model=row["model"], seq_len=row["seq_len"], variant=row["variant"],
            cuda_graph=bool(row.get("cuda_graph")),
            base=base_points[key][1] if key in base_points else None,
            head=head_points[key][1] if key in head_points else None), spec))
    by_guard = {(r["switch"], r["model"], r["seq_len"], r["on"], r["off"]): r for r in parity_rows}
    guards = [judge_guard(g, base_all, head_all, by_guard.get((g.switch, g.model, g.seq_len, g.on, g.off)), spec)
              for g in spec.guards]
    return points, guards

