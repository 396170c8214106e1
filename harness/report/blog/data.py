"""Rows -> the four roles a reader compares at each point: stock, the peer (Liger-Kernel), ours as
``optim.enable()`` gives it, and ours at its best setting. Roles come from what the rows record
(``role``, ``stack``, ``baseline_variant``), never from variant names."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness import results as res
from harness.report.fmt import _f, _natural, _stat
from harness.report.runs import _one_run
from harness.report.blog.style import gpu_short

OURS = ("ours", "ours-default")


@dataclass
class RolePoint:
    gpu: str  # gpu_slug
    device: str
    model: str
    seq_len: int
    rows: dict = field(default_factory=dict)  # role -> the row shown (ok, median repeat)
    failed: dict = field(default_factory=dict)  # role -> "oom" / "error" where no ok row

    @property
    def gpu_name(self) -> str:
        return gpu_short(self.device)

    def ms(self, role: str) -> float | None:
        return _stat(self.rows.get(role), "step_ms")

    def speedup(self, role: str) -> float | None:
        s, x = self.ms("stock"), self.ms(role)
        return s / x if s and x else None

    def one_run(self) -> bool | None:
        return _one_run(list(self.rows.values()))


def load_rows(results_root, experiments) -> list[dict]:
    return [r for name in experiments for r in res.load_experiment_rows(results_root, name)]


def _median_repeat(rows: list[dict]) -> dict | None:
    ok = sorted((r for r in rows if r.get("status") == "ok" and _stat(r, "step_ms") is not None),
                key=lambda r: _stat(r, "step_ms"))
    return ok[(len(ok) - 1) // 2] if ok else None


def _role_of(r: dict) -> set[str]:
    roles = set()
    if r.get("role") == "stock" and r.get("variant") == r.get("baseline_variant"):
        roles.add("stock")
    if r.get("stack") == "liger":
        roles.add("peer")
    if r.get("stack") == "user" and r.get("role") == "ours-default":
        roles.add("default")
    if r.get("role") in OURS:
        roles.add("best")
    return roles


def role_points(rows: list[dict]) -> list[RolePoint]:
    """One point per (GPU, model, length) on one GPU, with the row of each role it measured. Best is
    the fastest ok variant of ours (its median repeat); the others are their one variant."""
    steps = [r for r in rows if r.get("kind") == "step" and int(_f(r.get("gpus")) or 1) == 1]
    keys = sorted({(r.get("gpu_slug") or "unknown", str(r.get("model")), int(_f(r.get("seq_len")) or 0))
                   for r in steps}, key=lambda k: (k[0], _natural(k[1]), k[2]))
    out = []
    for gpu, model, t in keys:
        here = [r for r in steps if (r.get("gpu_slug") or "unknown", str(r.get("model")),
                                     int(_f(r.get("seq_len")) or 0)) == (gpu, model, t)]
        pt = RolePoint(gpu=gpu, device=str(here[0].get("device_name") or gpu), model=model, seq_len=t)
        for role in ("stock", "peer", "default", "best"):
            cand = [r for r in here if role in _role_of(r)]
            by_variant: dict[str, list[dict]] = {}
            for r in cand:
                by_variant.setdefault(str(r.get("variant")), []).append(r)
            picks = [p for v in by_variant.values() if (p := _median_repeat(v))]
            if picks:
                pt.rows[role] = min(picks, key=lambda r: _stat(r, "step_ms"))
            elif cand:
                pt.failed[role] = "/".join(sorted({str(r.get("status")) for r in cand}))
        out.append(pt)
    return out


def devices(rows: list[dict]) -> dict[str, str]:
    """gpu_slug -> short GPU name, for every GPU the rows ran on."""
    return {r.get("gpu_slug") or "unknown": gpu_short(r.get("device_name")) for r in rows if r.get("gpu_slug")}
