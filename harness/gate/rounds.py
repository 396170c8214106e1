"""The gate's rounds: the suite swept once per round, in the checkout of the side it measures.

Rounds alternate base, head, base, head, ... so that whatever drifts on the machine (clocks,
temperature, a neighbour on a shared GPU) lands on both sides alike. Each round is one fresh
``python -m harness sweep`` in that side's worktree, with that side's code, writing its rows
(the raw step samples included) under ``<out>/rounds/<NN>-<side>/``. A round that finished leaves
a ``done.json``; a gate run again with the same ``--out`` and the same commits resumes after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import results as res
from harness.gate.files import GateError

SIDES = ("base", "head")


def schedule(rounds: int) -> list[tuple[int, str]]:
    """(round number, side) in the order they run: base, head, base, head, ..."""
    return [(r, side) for r in range(1, rounds + 1) for side in SIDES]


@dataclass
class Round:
    number: int
    side: str
    sha: str
    path: Path  # the round's results root
    wall_s: float
    rows: list[dict]


def round_dir(out: Path, number: int, side: str) -> Path:
    return out / "rounds" / f"{number:02d}-{side}"


def _env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    # the round's git sha comes from its worktree; OPTIM_* would change what the switches resolve to
    for key in list(env):
        if key in ("PACKBENCH_GIT_SHA", "PACKBENCH_GIT_DIRTY") or key.startswith("OPTIM_"):
            del env[key]
    return env


def run_round(number: int, side: str, sha: str, tree: Path, suite: Path, out: Path,
              variants: list[str] | None = None, timeout_s: float | None = None) -> Round:
    """Sweep ``suite`` (``variants`` of it, default all) once in ``tree`` (a checkout of ``sha``),
    or read the round back if a previous run of this gate finished it."""
    where = round_dir(out, number, side)
    done = where / "done.json"
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("sha") == sha:
            return Round(number, side, sha, where, info.get("wall_s", 0.0), _rows(where, number, side, sha))
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "harness", "sweep", str(suite), "--results", str(where),
           "--no-report", "--quiet", "--overwrite", *(["--variants", *variants] if variants else [])]
    t0 = time.monotonic()
    with open(where / "sweep.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=tree, env=_env(tree), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise GateError(f"round {number} ({side}) ran past {timeout_s:.0f} s; its log: {where / 'sweep.log'}") from None
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = (where / "sweep.log").read_text()[-1500:]
        raise GateError(f"round {number} ({side}, {sha[:10]}) could not run the suite (exit {proc.returncode}); "
                        f"the last of its log ({where / 'sweep.log'}):\n{tail}")
    rows = _rows(where, number, side, sha)
    done.write_text(json.dumps({"sha": sha, "side": side, "round": number, "wall_s": wall}) + "\n")
    return Round(number, side, sha, where, wall, rows)


def _rows(where: Path, number: int, side: str, sha: str) -> list[dict]:
    rows = []
    for f in sorted(where.rglob("*.jsonl")):
        rows.extend(r for r in res.read_rows(f) if isinstance(r, dict) and r.get("kind") == "step")
    if not rows:
        raise GateError(f"round {number} ({side}) wrote no step rows under {where}")
    measured = {(r.get("env") or {}).get("git_sha") for r in rows}
    if measured != {sha}:
        raise GateError(f"round {number} ({side}) measured code at {', '.join(sorted(map(str, measured)))}, "
                        f"not its checkout {sha[:10]}: is `harness` imported from elsewhere (an installed "
                        f"copy on PYTHONPATH)?")
    for r in rows:
        r["_round"], r["_side"] = number, side
    return rows
