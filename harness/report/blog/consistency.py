"""The blog report's check on itself: one configuration measured by several runs whose medians
disagree is listed with each run's phases, never averaged, so a reader sees which figure is
current and where the time moved."""

from __future__ import annotations

from harness.report import fmt
from harness.report.blog.data import DISAGREE, Disagreement


def section(found: list[Disagreement]) -> str:
    if not found:
        return ""
    body = []
    for d in found:
        for exp, sha, when, r in d.runs:
            body.append([d.gpu, f"{d.model} {d.seq_len}", d.stack, f"`{exp}` @ {sha}", when[:16].replace("T", " "),
                         fmt.spread(r, "step_ms"), fmt.ms(fmt.stat(r, "forward_ms")), fmt.ms(fmt.stat(r, "backward_ms")),
                         fmt.ms(fmt.stat(r, "optimizer_ms")), _probe(r)])
    return "\n\n".join([
        "## Measurements that disagree",
        f"The same configuration (model, length, stack, switches, data) measured by more than one run, "
        f"with medians more than {DISAGREE:.0%} apart. Each run is listed; none is averaged away. A change in "
        "the code between the commits, or in the machine (the host CPU for an eager, host-bound step), "
        "can do this. The host probe (a fixed piece of pure Python timed when the row was written, where "
        "recorded) shows a slower or busier host; `python -m harness gate --base A --head B` on one GPU "
        "tells a code change apart.",
        fmt.table(["GPU", "point", "stack", "run (experiment @ commit)", "recorded", "step ms [p20–p80]", "forward",
                "backward", "optimizer", "host probe ms"], body)])


def _probe(r: dict) -> str:
    """The row's host speed probe (``env.host_probe_ms``; lower is faster), – where not recorded."""
    v = (r.get("env") or {}).get("host_probe_ms")
    return f"{v:.1f}" if isinstance(v, (int, float)) else "–"


def targets_note(found: list[Disagreement]) -> str:
    """Under the targets: a verdict is judged from its own experiment's rows, so where another run
    measured the same configuration apart, the reader is told which run each figure is."""
    if not found:
        return ""
    items = "; ".join(f"{d.model} {d.seq_len} ({d.stack}, {d.gpu}): "
                      + ", ".join(f"`{exp}` @ {sha} {fmt.ms(fmt.stat(r, 'step_ms'))} ms" for exp, sha, _, r in d.runs)
                      for d in found)
    return ("Each verdict is judged from its own experiment's rows. Another run measured these configurations "
            f"more than {DISAGREE:.0%} apart, so a verdict on them holds for the run it was judged from: {items}.")


def tldr_note(found: list[Disagreement]) -> str:
    if not found:
        return ""
    items = "; ".join(f"{d.model} {d.seq_len} ({d.stack}, {d.gpu}): {fmt.ms(fmt.stat(d.runs[0][3], 'step_ms'))} to "
                      f"{fmt.ms(fmt.stat(d.runs[-1][3], 'step_ms'))} ms" for d in found)
    return (f"**{len(found)} configuration{'s' if len(found) > 1 else ''} measured differently by two runs** "
            f"(see [Measurements that disagree](#measurements-that-disagree)): {items}.")
