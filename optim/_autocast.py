"""Whether autocast, where it is on, would change the dtype a fused path computes in."""

from __future__ import annotations

import torch


def changes(device_type: str, dtype: torch.dtype) -> bool:
    """True where autocast is on for ``device_type`` and casts to another dtype than ``dtype``: a
    fused path then leaves the module's own forward to run, as autocast's casts choose its dtypes
    (Trainer's ``bf16=True`` over fp32 weights). Autocast to the tensors' own dtype (``bf16=True``
    over a bf16 model, as most users load one) casts only fp32 LoRA adapters, to that dtype, as the
    fused paths do themselves: they run."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != dtype
