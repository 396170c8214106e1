"""What the compiled paths share (optim.moe, optim.packing, optim.regional): which errors their
fallback to eager must not swallow, and their own dynamo recompile limit."""

from __future__ import annotations

import torch

# One compiled function serves every model, shape and gate seen in a process: each is one more
# entry of its dynamo cache, and dynamo's default limit (8) was reached by the GPU test suite.
# A training run needs one or two entries.
RECOMPILE_LIMIT = 64


def recompile_limit(limit: int = RECOMPILE_LIMIT):
    """A context in which dynamo allows ``limit`` entries per code object (never fewer than set)."""
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{key: max(limit, getattr(cfg, key))})


def passes_through(e: BaseException) -> bool:
    """True for errors that are not the compiler's: out-of-memory is the run's, and checkpoint's
    recompute stops early by raising ``_StopRecomputationError`` through the forward."""
    return isinstance(e, torch.OutOfMemoryError) or type(e).__name__ == "_StopRecomputationError"
