"""Reading torch.profiler chrome traces: interval unions and the trace's event list."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping ``(start, end)`` intervals into disjoint sorted ones."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    """How much of ``[a, b)`` the disjoint intervals ``merged`` cover."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)


def trace_events(prof) -> list[dict]:
    """The chrome-trace events of a finished ``torch.profiler.profile``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]
