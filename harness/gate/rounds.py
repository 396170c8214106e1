"""The gate's rounds: the suite swept once per round, in the checkout of the side it measures.

Rounds alternate in pairs whose order flips, base, head, head, base, base, head, ... so that
whatever drifts on the machine (clocks, temperature, a neighbour on a shared GPU) lands on both
sides alike: in plain alternation one side always runs a slot later, and a steady drift would
read as a change. Each round is one
``python -m harness sweep`` of that side's code, in its worktree, writing its rows (the raw step
samples included) under ``<out>/rounds/<NN>-<side>/``; every point in it is a fresh process.
By default each side's sweeps run in one process that stays (``Server``, ``harness.gate.side``),
so the side pays its imports once, not every round; ``fresh=True``, or a revision that predates
it, runs one fresh process per round. A round that finished leaves a ``done.json``; a gate run
again with the same ``--out`` and the same commits resumes after it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import results as res
from harness.gate.files import GateError, check_row

SIDES = ("base", "head")


def schedule(rounds: int) -> list[tuple[int, str]]:
    """(round number, side) in the order they run: base first in odd rounds, head first in even
    ones (base, head, head, base, base, head, ...)."""
    return [(r, side) for r in range(1, rounds + 1) for side in (SIDES if r % 2 else SIDES[::-1])]


@dataclass
class Round:
    number: int
    side: str
    sha: str
    path: Path  # the round's results root
    wall_s: float
    rows: list[dict]
    resumed: bool = False  # finished by an earlier run of this gate


def round_dir(out: Path, number: int, side: str) -> Path:
    return out / "rounds" / f"{number:02d}-{side}"


def tree_env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    # the round's git sha comes from its worktree; OPTIM_* would change what the switches resolve to
    for key in list(env):
        if key in ("PACKBENCH_GIT_SHA", "PACKBENCH_GIT_DIRTY") or key.startswith("OPTIM_"):
            del env[key]
    return env


class Server:
    """One side's ``python -m harness _rounds SUITE`` (``harness.gate.side``): started at its first
    round, asked for each round's sweep, ended by ``close()``. ``mode`` says how that side's rounds
    ran: "server", or "fresh" (one process per round) when the revision has no round server or
    its server would not start; ``why`` says why."""

    START_TIMEOUT_S = 600.0

    def __init__(self, side: str, tree: Path, suite: Path, out: Path):
        self.side, self.tree, self.suite = side, tree, suite
        self.log_path = out / f"server-{side}.log"
        self.proc: subprocess.Popen | None = None
        self.mode, self.why = "server", ""

    def sweep(self, args: list[str], log: Path, timeout_s: float | None) -> int | None:
        """Run one round's sweep; its exit code, or None if this side runs fresh processes."""
        if self.mode == "fresh" or (self.proc is None and not self._start()):
            return None
        assert self.proc is not None
        self.proc.stdin.write(json.dumps({"argv": args, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if reply is None:
            self.close(kill=True)
            raise TimeoutError
        if "exit" not in reply:
            self.close(kill=True)
            raise GateError(f"the {self.side} side's round server stopped mid-round; its log: {self.log_path}:\n"
                            f"{self._tail()}")
        return reply["exit"]

    def _start(self) -> bool:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness", "_rounds", str(self.suite)], cwd=self.tree, env=tree_env(self.tree),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
        )
        log.close()
        reply = self._reply(self.START_TIMEOUT_S)
        if reply is not None and reply.get("ready"):
            return True
        self.close(kill=True)
        self.mode = "fresh"
        last = (self._tail(2000).strip().splitlines() or ["no output"])[-1][:200]
        self.why = f"its round server did not start ({last}; {self.log_path})"
        return False

    def _reply(self, timeout_s: float | None) -> dict | None:
        """The server's next protocol line as a dict; {} if it ended; None past ``timeout_s``."""
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1)  # byte by byte: nothing read past the line stays in a buffer
            if not chunk:
                return {}
            line += chunk
        try:
            reply = json.loads(line)
        except ValueError:
            return {}
        return reply if isinstance(reply, dict) else {}

    def _tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if not kill:
            try:
                proc.stdin.close()
                proc.wait(timeout=30)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server, its fork server and a point in flight
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def run_round(number: int, side: str, sha: str, tree: Path, suite: Path, out: Path,
              variants: list[str] | None = None, timeout_s: float | None = None,
              server: Server | None = None) -> Round:
    """Sweep ``suite`` (``variants`` of it, default all) once in ``tree`` (a checkout of ``sha``),
    through ``server`` if given, or read the round back if a previous run of this gate finished it."""
    where = round_dir(out, number, side)
    done = where / "done.json"
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("sha") == sha:
            return Round(number, side, sha, where, info.get("wall_s", 0.0), _rows(where, number, side, sha),
                         resumed=True)
    where.mkdir(parents=True, exist_ok=True)
    args = [str(suite), "--results", str(where), "--no-report", "--quiet", "--overwrite",
            *(["--variants", *variants] if variants else [])]
    t0 = time.monotonic()
    late = f"round {number} ({side}) ran past {timeout_s or 0:.0f} s; its log: {where / 'sweep.log'}"
    try:
        code = server.sweep(args, where / "sweep.log", timeout_s) if server is not None else None
    except TimeoutError:
        raise GateError(late) from None
    if code is None:
        with open(where / "sweep.log", "w") as log:
            try:
                code = subprocess.run([sys.executable, "-m", "harness", "sweep", *args], cwd=tree, env=tree_env(tree),
                                      stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                raise GateError(late) from None
    wall = time.monotonic() - t0
    if code != 0:
        tail = (where / "sweep.log").read_text()[-1500:]
        raise GateError(f"round {number} ({side}, {sha[:10]}) could not run the suite (exit {code}); "
                        f"the last of its log ({where / 'sweep.log'}):\n{tail}")
    rows = _rows(where, number, side, sha)
    done.write_text(json.dumps({"sha": sha, "side": side, "round": number, "wall_s": wall}) + "\n")
    return Round(number, side, sha, where, wall, rows)


def _rows(where: Path, number: int, side: str, sha: str) -> list[dict]:
    rows = []
    for f in sorted(where.rglob("*.jsonl")):
        for i, r in enumerate(res.read_rows(f), 1):
            if r.get("kind") == "step":
                check_row(f, i, r)  # as the files mode checks them: an ok row has a finite step time
                rows.append(r)
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
