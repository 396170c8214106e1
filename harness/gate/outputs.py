"""What a revisions gate writes: a Markdown summary fit for a pull-request comment, a JSON file in
github-action-benchmark's ``customSmallerIsBetter`` format, and the full verdict as JSON."""

from __future__ import annotations

import math
from dataclasses import asdict

from harness.gate import stats


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _interval(s: stats.Shift | None, fmt: str) -> str:
    if s is None:
        return "-"
    if not math.isfinite(s.high):  # too few rounds for an interval at this confidence
        return f"{format(s.estimate, fmt)} [no interval]"
    return f"{format(s.estimate, fmt)} [{format(s.low, fmt)}, {format(s.high, fmt)}]"


def _ms(side) -> str:
    if side is None:
        return "-"
    return f"{stats.median(side.step_ms):.1f}" if side.status == "ok" and side.step_ms else side.status


def _modes(modes: dict) -> str:
    """How each side's rounds ran, in words."""
    words = {"server": "one sweep process for all its rounds", "fresh": "one fresh sweep process per round"}
    if len(set(modes.values())) == 1:
        return f"; each side ran {words[next(iter(modes.values()))]}"
    return "".join(f"; {side} ran {words[mode]}" for side, mode in modes.items())


def markdown(report) -> str:
    spec = report.spec
    conf = f"{1 - spec.alpha:.0%}"
    head_line = "PASS" if not report.exit_code else "FAIL"
    out = [
        f"## Performance gate: {head_line}",
        "",
        (f"Base `{report.base_rev}` ({report.base_sha[:10]}) against head `{report.head_rev}` "
         f"({report.head_sha[:10]}), on {', '.join(report.device_names) or 'unknown device'}: "
         f"{spec.rounds} rounds each, interleaved base, head, head, base, ..., every point a fresh "
         f"process{_modes(report.round_modes)}. {report.wall_s / 60:.1f} min of rounds"
         + (f" and {report.parity_s / 60:.1f} min of parity checks" if report.parity_s else "")
         + f". Suite `{report.suite}`."),
        "",
        (f"A point fails when its change is significant (Mann-Whitney U on the per-round medians, "
         f"p < {spec.alpha:g}) and larger than +{spec.max_slowdown:.0%} step time or "
         f"+{spec.max_memory_mib:.0f} MiB peak memory; the ratio is the Hodges-Lehmann estimate with "
         f"its {conf} interval."),
    ]
    if report.underpowered:
        out += ["", (f"**Warning:** with {spec.rounds} rounds per side no p-value can fall below "
                     f"{spec.alpha:g} (the smallest is {stats.min_p(spec.rounds, spec.rounds):.3g}): "
                     f"time and memory cannot fail. Raise `rounds`.")]
    out += ["", f"| point | base ms | head ms | head/base [{conf}] | p | peak Δ MiB | verdict |",
            "|---|---:|---:|---|---:|---:|---|"]
    for p in report.points:
        mem = f"{p.memory.estimate:+.0f}" if p.memory is not None else "-"
        verdict = f"**FAIL {p.verdict}**" if p.outcome == "fail" else p.verdict
        out.append(f"| {p.label} | {_ms(p.base)} | {_ms(p.head)} | {_interval(p.time, '.3f')} | "
                   f"{f'{p.time.p:.2g}' if p.time else '-'} | {mem} | {verdict} |")
    if report.guards:
        out += ["", "### Switch guards", "",
                ("Each switch's own on/off pair in head's rounds: its speedup (off/on step time) against the "
                 "floor in the suite, and the loss and gradients of on against off on one fixed batch."), "",
                f"| switch | pair | speedup in head [{conf}] | floor | in base | parity: loss, grads, worst parameter (rel.) | verdict |",
                "|---|---|---|---:|---|---|---|"]
        for g in report.guards:
            par = g.parity
            if not g.guard.parity:
                ptxt = "not checked"
            elif par is None:
                ptxt = "missing"
            elif "loss_rel" in par:
                worst = f", {par['worst_rel']:.1e}" if "worst_rel" in par else ""
                ptxt = f"{par['loss_rel']:.1e}, {par['grad_rel']:.1e}{worst} {'ok' if par['ok'] else 'FAIL'}"
            else:
                ptxt = f"FAIL: {par.get('message', '')[:80]}"
            verdict = "ok" if g.ok else "**FAIL**"
            out.append(f"| `{g.guard.switch}` | {g.guard.model} T={g.guard.seq_len}: {g.guard.on} vs {g.guard.off} | "
                       f"{_interval(g.head, '.3f')} | {g.guard.min_speedup:g} | {_interval(g.base, '.3f')} | {ptxt} | {verdict} |")
    failures = [f"- `{p.label}`: {r}" for p in report.points if p.outcome == "fail" for r in p.reasons]
    failures += [f"- guard `{g.guard.switch}` ({g.guard.model} T={g.guard.seq_len}): {r}"
                 for g in report.guards if not g.ok for r in g.reasons]
    if failures:
        out += ["", "### Failures", "", *failures]
    warnings = [f"- `{p.label}`: {p.verdict}" for p in report.points if p.outcome == "warn"]
    if warnings:
        out += ["", "### Warnings", "", *warnings]
    out += ["", (f"Reproduce: `{report.command}`; rows of every round (raw step samples included) under "
                 f"`{report.out}/rounds/`.")]
    return "\n".join(out) + "\n"


def benchmark(report) -> list[dict]:
    """github-action-benchmark ``customSmallerIsBetter``: head's figures, one entry per metric."""
    out = []
    for p in report.points:
        h = p.head
        if h is None or h.status != "ok" or not h.step_ms:
            continue
        extra = f"base {_ms(p.base)} ms; head/base {_interval(p.time, '.3f')}"
        if p.time is not None:
            extra += f", p={p.time.p:.2g}"
        extra += f"; {p.verdict}"
        out.append({"name": f"{p.label} step time", "unit": "ms", "value": round(stats.median(h.step_ms), 4),
                    "range": f"± {(max(h.step_ms) - min(h.step_ms)) / 2:.4f}", "extra": extra})
        if h.peak_mib:
            out.append({"name": f"{p.label} peak memory", "unit": "MiB", "value": round(stats.median(h.peak_mib), 2),
                        "extra": f"base {stats.median(p.base.peak_mib):.2f} MiB" if p.base and p.base.peak_mib else ""})
    for g in report.guards:
        if g.head is not None:
            out.append({"name": f"guard {g.guard.switch}: {g.guard.on}/{g.guard.off} step time",
                        "unit": "ratio", "value": round(1 / g.head.estimate, 4),
                        "extra": f"speedup {g.head.estimate:.3f}x, floor {g.guard.min_speedup:g}x"})
    return out


def full(report) -> dict:
    """Everything the gate decided and from what, for a CI artifact."""
    return _finite({
        "outcome": "fail" if report.exit_code else "pass",
        "exit_code": report.exit_code,
        "base": {"rev": report.base_rev, "sha": report.base_sha},
        "head": {"rev": report.head_rev, "sha": report.head_sha},
        "device_names": report.device_names,
        "suite": report.suite,
        "spec": asdict(report.spec),
        "underpowered": report.underpowered,
        "rounds": [{"round": n, "side": s, "wall_s": w} for n, s, w in report.round_walls],
        "round_modes": report.round_modes,
        "parity_s": report.parity_s,
        "points": [asdict(p) for p in report.points],
        "guards": [asdict(g) for g in report.guards],
        "command": report.command,
    })
