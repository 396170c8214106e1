"""A gate suite's numerics check: for each guard (``[[gate.guards]]``), the loss and gradients of
its ``on`` variant against its ``off`` variant on one fixed batch, in one process.

Each side is built as its sweep point builds it (same seed, same weights, the same optim
switches), with every lora_B drawn non-zero first so the adapters take part, then runs one
forward and backward of the point's loss on the point's first batch, eagerly (a graphed point
replays the same kernels). The check passes when the losses differ by at most ``loss_tol``, the
trainable gradients together by at most ``grad_tol`` and each parameter's own by at most
``param_tol``, all relative to ``off``.

``python -m harness parity SUITE.toml [--json FILE]``; the gate runs it in the head's checkout.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds its parser from this module: keep torch out of its import
    from harness.run.experiment import Experiment
    from harness.run.gate_spec import Guard


def _side(point, spec) -> tuple[float, dict]:
    import torch

    from harness.run.point import prepare
    from harness.workload.models import randomize_lora_b

    run = prepare(point, spec, 1, after_build=randomize_lora_b)
    loss = run.forward(point, 0)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in run.model.named_parameters() if p.grad is not None}
    value = loss.item()
    del run, loss
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return value, grads


def compare(guard: Guard, off: tuple[float, dict], on: tuple[float, dict]) -> dict:
    """The verdict of one guard from each side's (loss, {parameter: gradient})."""
    (loss_off, g_off), (loss_on, g_on) = off, on
    out = {"loss_off": loss_off, "loss_on": loss_on, "loss_tol": guard.loss_tol, "grad_tol": guard.grad_tol,
           "param_tol": guard.param_tol}
    missing = sorted(set(g_off) ^ set(g_on))
    if missing:
        out.update(ok=False, message=f"the two sides train different parameters ({len(missing)} differ, "
                                     f"e.g. {missing[0]})")
        return out
    if not g_off or not any(bool(g.any()) for g in g_off.values()):
        out.update(ok=False, message="no parameter received a gradient" if not g_off else
                   "every gradient of the reference is zero: nothing to compare")
        return out
    diff2 = sum(float((g_on[n] - g_off[n]).square().sum()) for n in g_off)
    ref2 = sum(float(g_off[n].square().sum()) for n in g_off)
    # a parameter counts on its own only above a floor: a thousandth of the typical parameter's
    # reference gradient (a parameter the reference barely trains is no share of the step)
    norms = sorted(float(g.double().norm()) for g in g_off.values())
    floor = 1e-3 * norms[len(norms) // 2]
    rel = {n: _rel(g_on[n], g_off[n], floor) for n in g_off}
    worst = max(rel, key=lambda n: rel[n] if not math.isnan(rel[n]) else math.inf)
    out["loss_rel"] = abs(loss_on - loss_off) / max(abs(loss_off), 1e-12)
    out["grad_rel"] = math.sqrt(diff2 / ref2) if ref2 > 0 else (0.0 if diff2 == 0 else math.inf)
    out["worst_param"] = worst
    out["worst_rel"] = rel[worst]
    out["params_over"] = sum(1 for v in rel.values() if not v <= guard.param_tol)
    finite = all(math.isfinite(v) for v in (loss_on, loss_off, out["grad_rel"]))
    out["ok"] = (finite and out["loss_rel"] <= guard.loss_tol and out["grad_rel"] <= guard.grad_tol
                 and out["params_over"] == 0)
    out["message"] = "" if out["ok"] else (
        f"loss {loss_off:.5g} -> {loss_on:.5g} (rel {out['loss_rel']:.2e}, tol {guard.loss_tol:.0e}), "
        f"gradients rel {out['grad_rel']:.2e} (tol {guard.grad_tol:.0e})"
        + (f", {out['params_over']} parameter(s) past {guard.param_tol:g} on their own, worst {worst} "
           f"(rel {out['worst_rel']:.2e})" if out["params_over"] else ""))
    return out


def _rel(on, off, floor: float = 0.0) -> float:
    """One parameter's gradient error relative to its reference, or to ``floor`` where that is
    larger: 1.0 for a gradient dropped, inf for one where the reference has none (above no floor),
    0.0 where both are zero."""
    diff, ref = float((on.double() - off.double()).norm()), max(float(off.double().norm()), floor)
    if ref > 0:
        return diff / ref
    return 0.0 if diff == 0 else math.inf


def check(exp: Experiment, guard: Guard) -> dict:
    from harness.workload import models

    points = {p.variant: p for p in exp.points()
              if p.model == guard.model and p.seq_len == guard.seq_len and p.repeat == 0}
    spec = models.get(guard.model)
    row = {"switch": guard.switch, "model": guard.model, "seq_len": guard.seq_len, "on": guard.on, "off": guard.off}
    try:
        sides = {s: _side(dataclasses.replace(points[getattr(guard, s)], cuda_graph=False), spec) for s in ("off", "on")}
    except Exception as e:  # noqa: BLE001 - a side that cannot run is this guard's failure, not the run's
        row.update(ok=False, message=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-3000:])
        return row
    row.update(compare(guard, sides["off"], sides["on"]))
    return row


def main(args) -> int:
    from harness.run import experiment

    try:
        exp = experiment.load(args.suite)
        if exp.gate is None or not exp.gate.guards:
            raise experiment.ExperimentError(args.suite, "gate.guards", "this file has no [[gate.guards]] to check")
    except experiment.ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for guard in exp.gate.guards:
        row = check(exp, guard)
        rows.append(row)
        verdict = "ok" if row["ok"] else f"FAIL {row['message']}"
        print(f"parity {guard.switch} ({guard.model} T={guard.seq_len}, {guard.on} vs {guard.off}): "
              f"loss rel {row.get('loss_rel', math.nan):.2e}, grads rel {row.get('grad_rel', math.nan):.2e}, "
              f"worst parameter {row.get('worst_rel', math.nan):.2e}  {verdict}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"suite": str(args.suite), "guards": rows}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


def add_arguments(p) -> None:
    p.add_argument("suite", type=Path, help="a gate suite: an experiment file with [[gate.guards]]")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write each guard's figures to this JSON file")
