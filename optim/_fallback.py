"""What a compiled path's fallback to eager must not swallow (optim.moe, optim.regional)."""

from __future__ import annotations

import torch


def passes_through(e: BaseException) -> bool:
    """True for errors that are not the compiler's: out-of-memory is the run's, and checkpoint's
    recompute stops early by raising ``_StopRecomputationError`` through the forward."""
    return isinstance(e, torch.OutOfMemoryError) or type(e).__name__ == "_StopRecomputationError"
