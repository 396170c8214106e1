"""Whether autocast, where it is on, would change the dtype a fused path computes in, and the
fused backwards' shelter from it."""

from __future__ import annotations

import contextlib

import torch


def changes(device_type: str, dtype: torch.dtype) -> bool:
    """True where autocast is on for ``device_type`` and casts to another dtype than ``dtype``: a
    fused path then leaves the module's own forward to run, as autocast's casts choose its dtypes
    (Trainer's ``bf16=True`` over fp32 weights). Under autocast to the tensors' own dtype
    (``bf16=True`` over a bf16 model, as most users load one) the fused paths run: their matmuls
    take tensors of that dtype (the fp32 LoRA adapters cast to it, as autocast would cast them),
    and their fp32 math upcasts first, so autocast's fp32 ops get fp32 already. A fused path that
    fed an fp32-listed op (pow, exp, softmax...) a bf16 tensor would need more than this test."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != dtype


def off(device_type: str):
    """Autocast off on ``device_type`` where it is on: a fused backward's own dtypes stand where the
    caller ran ``loss.backward()`` inside autocast (the fp32 accumulations of the adapters'
    gradients would otherwise be cast down)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
