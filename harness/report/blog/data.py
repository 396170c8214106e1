"""Rows -> the parts a reader compares at each point (``harness.roles.PARTS``): stock, stock
compiled, the peer (Liger-Kernel), the user's path (``optim.enable()`` as a user calls it), and ours at its best
setting. Parts come from what the rows record (``role``, ``baseline_variant``), read through
``harness.roles``, never from variant names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from harness import results as res
from harness.roles import PARTS, PEERS, SIDE_BY_SIDE, parts, role_of
from harness.report import fmt
from harness.report.runs import from_one_run, median_repeat, split_runs, recorded_at
from harness.report.blog.style import gpu_short


@dataclass
class RolePoint:
    gpu: str  # gpu_slug
    device: str
    model: str
    seq_len: int
    rows: dict = field(default_factory=dict)  # role -> the row shown (ok, median repeat)
    low: dict = field(default_factory=dict)  # role -> its variant with the lowest peak (a peer run with and without checkpointing)
    failed: dict = field(default_factory=dict)  # role -> "oom" / "error" where no ok row

    @property
    def gpu_name(self) -> str:
        return gpu_short(self.device)

    def ms(self, role: str) -> float | None:
        return fmt.stat(self.rows.get(role), "step_ms")

    def speedup(self, role: str) -> float | None:
        s, x = self.ms("stock"), self.ms(role)
        return s / x if s and x else None

    def apart_from_stock(self, role: str) -> bool:
        """Whether ``role``'s row came from another run than the stock row beside it (False where
        either is missing or the rows cannot tell): its ratio over stock compares two runs."""
        stock, r = self.rows.get("stock"), self.rows.get(role)
        return role != "stock" and stock is not None and r is not None and from_one_run([stock, r]) is False

    def one_run(self) -> bool | None:
        return from_one_run(list(self.rows.values()))

    def over_fastest_peer(self) -> tuple[float | None, str | None]:
        """The user's path against the fastest of what a user would run instead (``PEERS``: stock,
        stock compiled, the peer) measured here: (ratio, that role)."""
        user = self.ms("user")
        fastest = min((r for r in PEERS if self.ms(r)), key=self.ms, default=None)
        return (self.ms(fastest) / user, fastest) if fastest and user else (None, None)

    def peers_run(self) -> list[str]:
        """The peers this point measured: an ok row, or a failure of the peer's own (oom, error).
        One skipped (not installed, a model it cannot load) did not run."""
        return [r for r in PEERS if r in self.rows
                or (r in self.failed and set(self.failed[r].split("/")) - {"skipped"})]

    def peers_short(self) -> str:
        """", N of 4 peers run" where not every peer ran, else "": a ratio over the fastest peer
        says when the fastest may be one not measured."""
        ran = self.peers_run()
        return f", {len(ran)} of {len(PEERS)} peers run" if len(ran) < len(PEERS) else ""


def load_rows(results_root, experiments) -> list[dict]:
    """The rows each experiment's report reads (``current.split``): its file as it is now, each
    point's newest code."""
    from harness.report import current

    return [r for name in experiments
            for r in current.split(results_root, name, res.load_experiment_rows(results_root, name)).rows]


_median_repeat = median_repeat


def _side_by_side(here: list[dict]) -> list[dict] | None:
    """The newest run (``runs.split_runs``, rows with a recording time) whose ok rows hold stock, the peer
    and enable() at this point, where there is one: all of that run's rows, its failures too, so a
    role that failed in it is shown failed rather than read from an older run."""
    for run in reversed([run for run in split_runs(here) if recorded_at(run[0])]):
        roles = set().union(*(parts(r) for r in run if r.get("status") == "ok"))
        if all(role in roles for role in SIDE_BY_SIDE):
            return run
    return None


def role_points(rows: list[dict]) -> list[RolePoint]:
    """One point per (GPU, model, length) on one GPU, with the row of each role it measured. Best is
    the fastest ok variant of ours (its median repeat); the others are their one variant. Where one
    run measured stock, the peer and enable() side by side, each role is read from the newest such
    run (best too, when that run ran a setting of ours beyond the defaults), so the ratios compare rows of one run;
    elsewhere each role's variant takes its median repeat over every run."""
    steps = [r for r in rows if r.get("kind") == "step" and int(fmt.number(r.get("gpus")) or 1) == 1]
    keys = sorted({(r.get("gpu_slug") or "unknown", str(r.get("model")), int(fmt.number(r.get("seq_len")) or 0))
                   for r in steps}, key=lambda k: (k[0], fmt.natural(k[1]), k[2]))
    out = []
    for gpu, model, t in keys:
        here = [r for r in steps if (r.get("gpu_slug") or "unknown", str(r.get("model")),
                                     int(fmt.number(r.get("seq_len")) or 0)) == (gpu, model, t)]
        pt = RolePoint(gpu=gpu, device=str(here[0].get("device_name") or gpu), model=model, seq_len=t)
        run = _side_by_side(here)
        for role in PARTS:
            cand = [r for r in here if role in parts(r)]
            if run is not None and (any(role_of(r) == "ours" for r in run) if role == "best"
                                    else any(role in parts(r) for r in run)):
                cand = [r for r in run if role in parts(r)]
            by_variant: dict[str, list[dict]] = {}
            for r in cand:
                by_variant.setdefault(str(r.get("variant")), []).append(r)
            picks = [p for v in by_variant.values() if (p := _median_repeat(v))]
            if picks:
                pt.rows[role] = min(picks, key=lambda r: fmt.stat(r, "step_ms"))
                peaked = [r for r in picks if fmt.number(r.get("peak_allocated_gib")) is not None]
                if peaked:
                    pt.low[role] = min(peaked, key=lambda r: float(r["peak_allocated_gib"]))
            elif cand:
                pt.failed[role] = "/".join(sorted({str(r.get("status")) for r in cand}))
        out.append(pt)
    return out


def devices(rows: list[dict]) -> dict[str, str]:
    """gpu_slug -> short GPU name, for every GPU the rows ran on."""
    return {r.get("gpu_slug") or "unknown": gpu_short(r.get("device_name")) for r in rows if r.get("gpu_slug")}


# Two runs of one configuration whose medians differ by more than this are listed, not averaged.
DISAGREE = 0.10
_CONFIG = ("gpu_slug", "model", "seq_len", "batch_size", "lora_rank", "dtype", "lora_dtype", "loss_mode",
           "measured_steps")


def _config(r: dict) -> tuple:
    """What a row ran, as far as the rows say: the point, the stack, the switches and the data. Rows
    equal here measure the same thing, whatever experiment or variant name they came under."""
    return (*(r.get(k) for k in _CONFIG), bool(r.get("cuda_graph")), r.get("stack") or "transformers",
            json.dumps(r.get("switches"), sort_keys=True, default=str),
            json.dumps(r.get("data"), sort_keys=True, default=str))


@dataclass
class Disagreement:
    """One configuration measured by several runs (experiment × code) whose medians disagree."""
    model: str
    seq_len: int
    gpu: str
    stack: str
    runs: list  # [(experiment, git sha, recorded_at, the median-repeat row)], fastest first

    @property
    def ratio(self) -> float:
        return fmt.stat(self.runs[-1][3], "step_ms") / fmt.stat(self.runs[0][3], "step_ms")


def disagreements(rows: list[dict], tolerance: float = DISAGREE) -> list[Disagreement]:
    """Configurations that two or more runs measured, where the slowest run's median step exceeds the
    fastest's by more than ``tolerance``. A run is an experiment's rows of one code version
    (``code_sha``, else the commit)."""
    groups: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in rows:
        if r.get("kind") != "step" or int(fmt.number(r.get("gpus")) or 1) != 1 or fmt.stat(r, "step_ms") is None \
                or r.get("status") != "ok":
            continue
        env = r.get("env") or {}
        run = (str(r.get("experiment")), str(env.get("code_sha") or env.get("git_sha") or "?"))
        groups.setdefault(_config(r), {}).setdefault(run, []).append(r)
    out = []
    for runs in groups.values():
        if len(runs) < 2:
            continue
        picks = sorted(((exp, str((m.get("env") or {}).get("git_sha") or "?")[:8], str(m.get("recorded_at") or "?"), m)
                        for (exp, _), rs in runs.items() if (m := _median_repeat(rs))),
                       key=lambda x: fmt.stat(x[3], "step_ms"))
        first = picks[0][3]
        d = Disagreement(str(first.get("model")), int(fmt.number(first.get("seq_len")) or 0), gpu_short(first.get("device_name")),
                         str(first.get("stack") or "transformers"), picks)
        if d.ratio > 1 + tolerance:
            out.append(d)
    return sorted(out, key=lambda d: (d.gpu, fmt.natural(d.model), d.seq_len, d.stack))
