"""The gate's numerics verdict on synthetic gradients: what a global relative error cannot see.
A switch that drops one small parameter's gradient, or gives one the reference has none of, fails
its guard by name; bf16-sized noise on every parameter passes."""

from __future__ import annotations

import math

import torch

from harness.run.gate_spec import Guard
from harness.run.parity import compare

GUARD = Guard(switch="packing_cache", model="m", seq_len=64, on="on", off="off", min_speedup=1.0)


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.q_proj.lora_A": torch.randn(4096, generator=g) * 10,
            "layers.0.q_proj.lora_B": torch.randn(4096, generator=g) * 10,
            "layers.1.router.lora_A": torch.randn(16, generator=g)}


def test_noise_on_every_parameter_passes():
    off = _grads()
    noise = _grads(seed=1)
    on = {n: g + 0.03 * g.norm() / math.sqrt(g.numel()) * noise[n] / noise[n].std() for n, g in off.items()}
    out = compare(GUARD, (2.0, off), (2.0, on))
    assert out["ok"], out
    assert 0.01 < out["worst_rel"] < 0.1 and out["params_over"] == 0


def test_one_small_gradient_dropped_fails_though_the_global_error_is_inside_its_tolerance():
    off = _grads()
    on = {**off, "layers.1.router.lora_A": torch.zeros(16)}
    out = compare(GUARD, (2.0, off), (2.0, on))
    assert out["grad_rel"] < GUARD.grad_tol  # the global figure alone would let it through
    assert not out["ok"]
    assert out["worst_param"] == "layers.1.router.lora_A" and out["worst_rel"] == 1.0
    assert "1 parameter(s) past 0.25" in out["message"] and "layers.1.router.lora_A" in out["message"]


def test_a_gradient_where_the_reference_has_none_fails():
    off = {**_grads(), "layers.1.router.lora_A": torch.zeros(16)}
    on = {**off, "layers.1.router.lora_A": torch.full((16,), 10.0)}
    out = compare(GUARD, (2.0, off), (2.0, on))
    assert not out["ok"] and out["worst_param"] == "layers.1.router.lora_A" and out["params_over"] == 1


def test_a_nan_in_one_parameter_fails_and_is_named():
    off = _grads()
    on = {**off, "layers.1.router.lora_A": torch.full((16,), float("nan"))}
    out = compare(GUARD, (2.0, off), (2.0, on))
    assert not out["ok"] and out["worst_param"] == "layers.1.router.lora_A"


def test_both_sides_without_a_gradient_for_a_parameter_agree():
    off = {**_grads(), "layers.1.router.lora_A": torch.zeros(16)}
    out = compare(GUARD, (2.0, off), (2.0, dict(off)))
    assert out["ok"] and out["worst_rel"] == 0.0


def test_a_reference_without_any_gradient_is_no_pass():
    off = {n: torch.zeros_like(g) for n, g in _grads().items()}
    out = compare(GUARD, (2.0, off), (2.0, dict(off)))
    assert not out["ok"] and "every gradient of the reference is zero" in out["message"]


def test_a_parameter_the_reference_barely_trains_is_judged_against_a_floor():
    """Below a thousandth of the typical parameter's reference gradient, noise on a parameter the
    reference leaves at zero is no failure; a real gradient there still is."""
    off = {**_grads(), "layers.1.router.lora_A": torch.zeros(16)}
    typical = sorted(float(g.norm()) for g in off.values())[1]
    on = {**off, "layers.1.router.lora_A": torch.full((16,), 1e-5 * typical / 4)}  # norm 1e-5 of typical
    assert compare(GUARD, (2.0, off), (2.0, on))["ok"]
    on["layers.1.router.lora_A"] = torch.full((16,), 1e-2 * typical / 4)
    assert not compare(GUARD, (2.0, off), (2.0, on))["ok"]
