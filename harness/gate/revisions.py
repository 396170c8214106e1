"""``python -m harness gate --base REV --head REV``: both revisions measured on this machine, in one
job, as asv's ``continuous`` does.

1. Each revision is checked out into its own worktree (``harness.gate.worktrees``).
2. The suite (default: head's ``experiments/gate.toml``) is copied into ``--out`` and both sides
   sweep that one copy, each with its own code, in interleaved rounds (``harness.gate.rounds``).
3. Head's checkout runs the suite's numerics checks (``python -m harness parity``).
4. Every point and every switch guard is judged (``harness.gate.verdict``), and the summary, the
   benchmark JSON and the full verdict are written to ``--out`` (``harness.gate.outputs``).

Exit status (``cli``): 0 pass, 1 regression or failed guard, 2 unusable input (a revision that does
not resolve, a suite that does not load or that a side cannot run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.gate import outputs, rounds, stats, verdict, worktrees
from harness.gate.files import GateError
from harness.run.gate_spec import GateSpec

DEFAULT_SUITE = Path("experiments") / "gate.toml"


@dataclass
class RevisionsReport:
    base_rev: str
    head_rev: str
    base_sha: str
    head_sha: str
    suite: str
    out: str
    spec: GateSpec
    device_names: list[str]
    points: list[verdict.PointVerdict]
    guards: list[verdict.GuardVerdict]
    round_walls: list[tuple[int, str, float]] = field(default_factory=list)
    command: str = ""
    # per side, how its rounds ran: "server" (one process for all of them) or "fresh" (one per round)
    round_modes: dict[str, str] = field(default_factory=dict)
    parity_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return sum(w for _, _, w in self.round_walls)

    @property
    def underpowered(self) -> bool:
        return stats.min_p(self.spec.rounds, self.spec.rounds) >= self.spec.alpha

    @property
    def failed(self) -> list[str]:
        return ([p.label for p in self.points if p.outcome == "fail"]
                + [f"guard {g.guard.switch}" for g in self.guards if not g.ok])

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def _load_suite(path: Path):
    from harness.run import experiment

    try:
        exp = experiment.load(path)
    except experiment.ExperimentError as e:
        raise GateError(str(e)) from None
    if exp.gate is None:
        raise GateError(f"{path}: not a gate suite (no [gate] table); see experiments/gate.toml")
    return exp


def _plan(out: Path, base_sha: str, head_sha: str, suite_text: str) -> None:
    """Record what ``out`` holds; refuse to mix two gates' rounds in one directory."""
    plan = out / "plan.json"
    mine = {"base": base_sha, "head": head_sha, "suite_sha": hashlib.sha256(suite_text.encode()).hexdigest()}
    if plan.exists():
        have = json.loads(plan.read_text())
        if have != mine:
            raise GateError(f"{out} holds the rounds of another gate (base {have.get('base', '?')[:10]}, head "
                            f"{have.get('head', '?')[:10]}, or another suite); pass another --out or remove it")
        return
    plan.write_text(json.dumps(mine) + "\n")


def _parity(tree: Path, suite: Path, out: Path, head_sha: str, log) -> list[dict]:
    path = out / "parity.json"
    done = out / "parity.done"
    if path.exists() and done.exists() and done.read_text().strip() == head_sha:
        return json.loads(path.read_text())["guards"]
    log("parity: head's loss and gradients, each guard's on against off")
    with open(out / "parity.log", "w") as f:
        proc = subprocess.run([sys.executable, "-m", "harness", "parity", str(suite), "--json", str(path)],
                              cwd=tree, env=rounds.tree_env(tree), stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode not in (0, 1) or not path.exists():
        tail = (out / "parity.log").read_text()[-1500:]
        raise GateError(f"head could not run the parity checks (exit {proc.returncode}); the last of "
                        f"{out / 'parity.log'}:\n{tail}")
    done.write_text(head_sha + "\n")
    return json.loads(path.read_text())["guards"]


def run(base: str, head: str, *, out: Path, repo: Path, suite: Path | None = None, rounds_n: int | None = None,
        alpha: float | None = None, max_slowdown: float | None = None, max_memory_mib: float | None = None,
        round_timeout_s: float | None = None, fresh_rounds: bool = False, command: str = "",
        log=None) -> RevisionsReport:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    repo = worktrees.toplevel(repo)
    shas = {"base": worktrees.resolve(repo, base), "head": worktrees.resolve(repo, head)}
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with worktrees.checkouts(repo, shas) as trees:
        source = Path(suite).resolve() if suite is not None else trees["head"] / DEFAULT_SUITE
        if not source.exists():
            raise GateError(f"{source}: suite not found" + ("" if suite else " in head's checkout; pass --suite"))
        text = source.read_text()
        copy = out / "suite.toml"
        _plan(out, shas["base"], shas["head"], text)
        copy.write_text(text)
        exp = _load_suite(copy)
        spec = exp.gate
        overrides = {k: v for k, v in (("rounds", rounds_n), ("alpha", alpha), ("max_slowdown", max_slowdown),
                                       ("max_memory_mib", max_memory_mib)) if v is not None}
        spec = dataclasses.replace(spec, **overrides)
        shown_suite = str(suite) if suite is not None else str(DEFAULT_SUITE)
        order = rounds.schedule(spec.rounds)
        log(f"gate: base {base} ({shas['base'][:10]}) vs head {head} ({shas['head'][:10]}), suite {shown_suite}, "
            f"{spec.rounds} rounds each; judged: {', '.join(spec.variants_for('base', 1, list(exp.variants)))}; "
            f"out {out}")
        done: dict[str, list[dict]] = {"base": [], "head": []}
        walls = []
        servers = {side: None if fresh_rounds else rounds.Server(side, trees[side], copy, out) for side in shas}
        t0 = time.monotonic()
        try:
            for i, (number, side) in enumerate(order, 1):
                variants = spec.variants_for(side, number, list(exp.variants))
                r = rounds.run_round(number, side, shas[side], trees[side], copy, out, variants=variants,
                                     timeout_s=round_timeout_s, server=servers[side])
                done[side].extend(r.rows)
                walls.append((number, side, r.wall_s))
                server = servers[side]
                if server is not None and server.why:
                    log(f"{side}: {server.why}; one fresh process per round")
                    server.why = ""
                log(f"round {i}/{len(order)}: {side} {shas[side][:10]} " + (
                    f"finished by an earlier run ({r.wall_s:.1f} s)" if r.resumed else
                    f"in {r.wall_s:.1f} s (elapsed {(time.monotonic() - t0) / 60:.1f} min)"))
        finally:
            for server in servers.values():
                if server is not None:
                    server.close()
        modes = {side: "fresh" if s is None else s.mode for side, s in servers.items()}
        t_parity = time.monotonic()
        parity = (_parity(trees["head"], copy, out, shas["head"], log)
                  if any(g.parity for g in spec.guards) else [])
        parity_s = time.monotonic() - t_parity
    judged = set(spec.variants_for("base", 1, list(exp.variants)))
    points, guards = verdict.judge([r for r in done["base"] if r["variant"] in judged],
                                   [r for r in done["head"] if r["variant"] in judged], spec, parity,
                                   guard_rows=done["head"], base_guard_rows=done["base"])
    devices = sorted({r.get("device_name") or "unknown" for r in done["base"] + done["head"]})
    report = RevisionsReport(base, head, shas["base"], shas["head"], shown_suite, str(out), spec, devices,
                             points, guards, walls, command, modes, parity_s)
    write(report, out)
    return report


def write(report: RevisionsReport, out: Path) -> dict[str, Path]:
    paths = {"summary": out / "summary.md", "benchmark": out / "benchmark.json", "verdict": out / "gate.json"}
    paths["summary"].write_text(outputs.markdown(report))
    paths["benchmark"].write_text(json.dumps(outputs.benchmark(report), indent=2) + "\n")
    paths["verdict"].write_text(json.dumps(outputs.full(report), indent=2, default=str) + "\n")
    return paths
