"""The host side of training steps under cProfile: where a host-bound step's time goes.

A step whose host takes longer to issue its kernels than the GPU takes to run them is as fast as
its Python: the time goes to the functions that issue, and to the calls that wait on a host sync
(``.item()``, a blocking copy). ``write`` turns a ``cProfile.Profile`` of ``steps`` steps into a
text file (own time summed by package, then the top functions by own and by cumulative time, per
step) beside the raw ``.pstats``, so two paths (``tools/user_loop.py``'s loop and
``harness.bench.trainer``'s Trainer) read side by side.
"""

from __future__ import annotations

import io
import pstats
from pathlib import Path


def by_package(stats: pstats.Stats) -> dict[str, float]:
    """Own time summed by where the function lives: a package path two levels deep (torch/_dynamo,
    peft/tuners), or the C function a builtin calls (the dispatcher's ops and kernel launches)."""
    out: dict[str, float] = {}
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
        if file == "~":
            bucket = "builtin: torch (C++ ops and launches)" if "torch" in name else "builtin: other"
        else:
            parts = Path(file).parts
            tail = parts[parts.index("site-packages") + 1:] if "site-packages" in parts else parts[-3:]
            bucket = "/".join(p for p in tail[:2] if not p.endswith(".py")) or tail[0]
        out[bucket] = out.get(bucket, 0.0) + tottime
    return out


def write(prof, path: str | Path, steps: int = 1, title: str = "") -> float:
    """Write ``prof``'s ``steps`` steps to ``path`` (text) and ``path``.pstats; returns the profiled
    milliseconds per step (cProfile's own overhead included: compare two files, not a file and a
    step time)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.dump_stats(f"{path}.pstats")
    total = sum(v[2] for v in stats.stats.values())
    per_step = total * 1e3 / steps
    out.write(f"# {title}\n\n" if title else "")
    out.write(f"## own time by package ({per_step:.1f} ms per step over {steps} step(s), profiled)\n")
    for bucket, t in sorted(by_package(stats).items(), key=lambda kv: -kv[1]):
        out.write(f"{t * 1e3 / steps:9.1f} ms  {100 * t / total if total else 0.0:5.1f} %  {bucket}\n")
    out.write(f"\n## by own time ({steps} step(s))\n")
    stats.sort_stats("tottime").print_stats(40)
    out.write(f"\n## by cumulative time ({steps} step(s))\n")
    stats.sort_stats("cumulative").print_stats(60)
    Path(path).write_text(out.getvalue())
    return per_step
