"""``[gate]``: how ``python -m harness gate`` runs and judges an experiment file as a regression-gate
suite, and its ``[[gate.guards]]`` (a switch's own on/off pair)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.roles import ROLES
from harness.run.fields import ExperimentError, check_keys, choice, integer, positive_number
from harness.variant_keys import OWNER, SWITCHES, resolve
from harness.workload import models as model_registry


@dataclass(frozen=True)
class Guard:
    """A switch's own on/off pair in a gate suite: the gate fails when the measured speedup of
    ``on`` over ``off`` falls below ``min_speedup``, or when their loss and gradients on one fixed
    batch differ by more than the tolerances (relative; bf16 rounding stays well inside them).
    ``grad_tol`` bounds the gradients' error over every trainable parameter together, ``param_tol``
    each parameter's own: a switch that drops one small parameter's gradient (relative error 1)
    moves the global figure by as little as that parameter's share of the total, and fails here."""

    switch: str  # a switch name, or "optim.enable" for the user path against stock
    model: str
    seq_len: int
    on: str
    off: str
    min_speedup: float
    parity: bool = True
    loss_tol: float = 2e-2
    grad_tol: float = 5e-2
    # Far above what bf16 moves one parameter in the GPU gate suite's guards, MoE's top-k ties
    # included (``worst_rel`` in results/gate/*/parity.json), and far below a dropped gradient.
    param_tol: float = 0.25


@dataclass(frozen=True)
class GateSpec:
    """``[gate]``: how ``python -m harness gate --base --head`` runs and judges this suite."""

    rounds: int = 5  # per side, interleaved base, head, head, base, ...
    alpha: float = 0.01  # a change counts only when significant at this level (Mann-Whitney U)
    max_slowdown: float = 0.05  # ... and larger than this fraction of step time
    max_memory_mib: float = 64.0  # ... or this much peak allocated memory
    guards: tuple[Guard, ...] = ()
    # The variants judged base against head, swept in every round of both sides (default: all);
    # the file names them by role (every variant playing it) or by name. The others exist for the
    # guards alone: swept in head's first ``guard_rounds`` rounds only.
    judge: tuple[str, ...] = ()
    guard_rounds: int = 0  # 0: every round

    def variants_for(self, side: str, number: int, variants: list[str]) -> list[str]:
        """The variants a round sweeps: the judged ones, and on head's guard rounds every one."""
        judged = [v for v in variants if not self.judge or v in self.judge]
        if side == "head" and number <= (self.guard_rounds or self.rounds):
            return list(variants)
        return judged


ENABLE_GUARD = "optim.enable"  # a guard's switch name for the user's path (role user) vs stock
GATE_KEYS = {"rounds", "alpha", "max_slowdown", "max_memory_mib", "guards", "judge", "guard_rounds"}
GUARD_KEYS = {"switch", "model", "seq_len", "on", "off", "min_speedup", "parity", "loss_tol", "grad_tol",
              "param_tol"}


def parse_gate(path, raw: Any, models: list[str], seq_lens: list[int], variants: dict, variant_models: dict,
               variant_seq_lens: dict, roles: dict) -> GateSpec:
    """``[gate]`` and its ``[[gate.guards]]``, each guard's pair checked against the variants."""
    from harness.gate.files import parse_fraction

    check_keys(path, "gate", raw, GATE_KEYS)
    try:
        max_slowdown = parse_fraction(raw.get("max_slowdown", "5%"))
    except ValueError as e:
        raise ExperimentError(path, "gate.max_slowdown", str(e)) from None
    max_memory = raw.get("max_memory_mib", 64)
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)) or max_memory < 0:
        raise ExperimentError(path, "gate.max_memory_mib", f"must be a number of MiB >= 0, got {max_memory!r}")
    guards_raw = raw.get("guards", [])
    if not isinstance(guards_raw, list):
        raise ExperimentError(path, "gate.guards", "must be an array of tables ([[gate.guards]])")
    guards = []
    for i, g in enumerate(guards_raw):
        where = f"gate.guards[{i}]"
        check_keys(path, where, g, GUARD_KEYS)
        for key in ("switch", "model", "seq_len", "on", "off", "min_speedup"):
            if key not in g:
                raise ExperimentError(path, f"{where}.{key}", "missing required key")
        try:
            model = model_registry.get(g["model"]).name
        except KeyError:
            model = None
        choice(path, f"{where}.model", model if model in models else g["model"], models)
        choice(path, f"{where}.seq_len", g["seq_len"], seq_lens)
        for side in ("on", "off"):
            v = choice(path, f"{where}.{side}", g[side], list(variants))
            if model not in variant_models.get(v, [model]):
                raise ExperimentError(path, f"{where}.{side}", f"variant {v!r} does not run on {model} (its models)")
            if g["seq_len"] not in variant_seq_lens.get(v, [g["seq_len"]]):
                raise ExperimentError(path, f"{where}.{side}",
                                      f"variant {v!r} does not run at {g['seq_len']} tokens (its seq_lens)")
        switch, on, off = g["switch"], g["on"], g["off"]
        if switch == ENABLE_GUARD:
            if roles.get(on) != "user" or roles.get(off) != "stock" or any(k in OWNER for k in variants[off]):
                raise ExperimentError(path, f"{where}.switch", f"{ENABLE_GUARD!r} guards optim.enable against "
                                      "stock: 'on' needs role 'user', 'off' role 'stock' and no optim switch")
        else:
            choice(path, f"{where}.switch", switch, [*SWITCHES, ENABLE_GUARD])
            if resolve(variants[on]).get(switch) == resolve(variants[off]).get(switch):
                raise ExperimentError(path, f"{where}.switch", f"variants {on!r} and {off!r} set {switch} alike, "
                                      "so this pair measures something else")
        parity = g.get("parity", True)
        if not isinstance(parity, bool):
            raise ExperimentError(path, f"{where}.parity", f"must be true or false, got {parity!r}")
        guards.append(Guard(
            switch=switch, model=model, seq_len=g["seq_len"], on=on, off=off,
            min_speedup=positive_number(path, f"{where}.min_speedup", g["min_speedup"]), parity=parity,
            loss_tol=positive_number(path, f"{where}.loss_tol", g.get("loss_tol", Guard.loss_tol), below=1),
            grad_tol=positive_number(path, f"{where}.grad_tol", g.get("grad_tol", Guard.grad_tol), below=1),
            param_tol=positive_number(path, f"{where}.param_tol", g.get("param_tol", Guard.param_tol), below=1),
        ))
    judge = _judged(path, raw.get("judge", []), variants, roles)
    rounds = integer(path, "gate.rounds", raw.get("rounds", GateSpec.rounds), 2)
    guard_rounds = integer(path, "gate.guard_rounds", raw.get("guard_rounds", rounds), 1)
    if guard_rounds > rounds:
        raise ExperimentError(path, "gate.guard_rounds", f"must be at most rounds ({rounds}), got {guard_rounds}")
    return GateSpec(
        rounds=rounds, judge=tuple(judge), guard_rounds=guard_rounds,
        alpha=positive_number(path, "gate.alpha", raw.get("alpha", GateSpec.alpha), below=0.5),
        max_slowdown=max_slowdown, max_memory_mib=float(max_memory), guards=tuple(guards),
    )


def _judged(path, raw: Any, variants: dict, roles: dict) -> list[str]:
    """``[gate] judge``: roles (every variant playing one: ``"user"`` judges the user's path on
    each model that variant runs on) or variant names, as the variants they pick, in file order."""
    if not isinstance(raw, list):
        raise ExperimentError(path, "gate.judge", "must be a list of roles or variant names",
                              [*ROLES, *variants])
    picked: set[str] = set()
    for i, entry in enumerate(raw):
        if entry in ROLES:
            playing = {v for v in variants if roles.get(v) == entry}
            if not playing:
                raise ExperimentError(path, f"gate.judge[{i}]", f"no variant plays role {entry!r}",
                                      sorted({r for r in roles.values() if r}))
            picked |= playing
        else:
            picked.add(choice(path, f"gate.judge[{i}]", entry, [*ROLES, *variants]))
    return [v for v in variants if v in picked]
