"""The regression gate's own targets, judged from the gate runs kept under ``results/gate/<run>/``
(``gate.json``, written by ``python -m harness gate --out``), as the plan's ``[blog.gate]`` names
them:

    [blog.gate]
    a_a = ["a-a-4"]                              # head against itself: passes, every interval holds 1.0
    max_half_width = 0.05                        # ... within this fraction of 1.0
    must_fail = { planted-cache-off = "packing_cache", planted-mem256 = "memory",
                  planted-recompute-all = "time" }  # and says why: a guard, memory or step time
    must_pass = ["planted-sleep3"]               # a slowdown below the threshold
    max_minutes = 8                              # rounds and parity, on one GPU
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.report import fmt

DASH = "–"


def _load(root: Path, run: str) -> dict | None:
    try:
        return json.loads((root / run / "gate.json").read_text())
    except (OSError, ValueError):
        return None


def _interval(t: dict | None) -> str:
    return f"{t['estimate']:.3f} [{t['low']:.3f}, {t['high']:.3f}]" if t and t.get("high") is not None else DASH


def _holds_one(p: dict) -> bool:
    t = p.get("time") or {}
    return t.get("low") is not None and t.get("high") is not None and t["low"] <= 1.0 <= t["high"]


def _failed_switches(g: dict) -> list[str]:
    return [x["guard"]["switch"] for x in g.get("guards") or [] if not x.get("ok", True)]


def _half_width(p: dict) -> float:
    t = p.get("time") or {}
    return (t["high"] - t["low"]) / 2 if t.get("low") is not None and t.get("high") is not None else float("inf")


def _minutes(g: dict) -> float:
    return (sum(r.get("wall_s") or 0 for r in g.get("rounds") or []) + (g.get("parity_s") or 0)) / 60


def _met(ok: bool) -> fmt.Cell:
    return fmt.Cell("met" if ok else "not met", ok)


def targets(root: Path | str, spec: dict) -> str:
    """``### gate``: each of the gate's targets with what its run measured ("" without ``spec``)."""
    if not spec:
        return ""
    root, body = Path(root), []
    for run in spec.get("a_a") or []:
        g = _load(root, run)
        width = spec.get("max_half_width")
        goal = ("A/A: head against itself passes, every interval holding 1.0"
                + (f" within ±{width:.0%}" if width else "") + f" (`{run}`)")
        if g is None:
            body.append([goal, "not measured", fmt.Cell(DASH, None)])
            continue
        pts = g.get("points") or []
        widest = max(map(_half_width, pts), default=float("inf"))
        seen = f"{g.get('outcome')}; " + ", ".join(_interval(p.get("time")) for p in pts)
        body.append([goal, seen + (f"; widest ±{widest:.1%}" if width else ""),
                     _met(g.get("outcome") == "pass" and bool(pts) and all(map(_holds_one, pts))
                          and (not width or widest <= width))])
    for run, why in (spec.get("must_fail") or {}).items():
        g = _load(root, run)
        goal = f"a planted {why} regression fails and names it (`{run}`)"
        if g is None:
            body.append([goal, "not measured", fmt.Cell(DASH, None)])
            continue
        if why in ("memory", "time"):
            verdict = "MEMORY" if why == "memory" else "SLOWER"
            named = [p.get("label") for p in g.get("points") or [] if p.get("verdict") == verdict]
            seen = f"{g.get('outcome')}; {verdict} on {', '.join(named) or 'no point'}"
        else:
            named = [s for s in _failed_switches(g) if s == why]
            seen = f"{g.get('outcome')}; failing guards: {', '.join(_failed_switches(g)) or 'none'}"
        body.append([goal, seen, _met(g.get("outcome") == "fail" and bool(named))])
    for run in spec.get("must_pass") or []:
        g = _load(root, run)
        goal = f"a slowdown below the threshold passes (`{run}`)"
        body.append([goal, "not measured", fmt.Cell(DASH, None)] if g is None else
                    [goal, f"{g.get('outcome')}; " + ", ".join(_interval(p.get("time")) for p in g.get("points") or []),
                     _met(g.get("outcome") == "pass")])
    if "max_minutes" in spec:
        runs = [(run, g) for run in spec.get("a_a") or [] if (g := _load(root, run)) and g.get("rounds")]
        goal = f"the suite finishes in ≤ {spec['max_minutes']:g} minutes on one GPU, rounds and parity included"
        if not runs:
            body.append([goal, "not measured", fmt.Cell(DASH, None)])
        else:
            run, g = runs[-1]
            m = _minutes(g)
            body.append([goal, fmt.Cell(f"{m:.1f} min (`{run}`)", m), _met(m <= spec["max_minutes"])])
    return "### `gate`\n\n" + fmt.table(["target", "measured", "met?"], body) if body else ""
