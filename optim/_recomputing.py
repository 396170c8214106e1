"""Whether the code running is a layer's recompute whose outputs nobody reads.

``optim.offload`` recomputes a checkpointed layer in its backward only to rebuild what the
layer's backward needs: the recomputed outputs are the roots ``torch.autograd.backward`` starts
from, and their values are read by nothing. A module whose output reaches the layer's output only
through a residual add (whose backward reads no values) may then skip computing it, as long as it
saves what its own backward needs. ``optim.mlp`` does so for its chunked MLP in Llama-shaped
decoder layers; anything else computes as always.

The flag is thread-local: autograd runs a device's backward on one thread, and the recompute's
forward runs on that thread, inside the ``with``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_LOCAL = threading.local()


@contextmanager
def outputs_unread():
    """Mark the code inside as a recompute whose outputs only root a backward."""
    before = getattr(_LOCAL, "unread", False)
    _LOCAL.unread = True
    try:
        yield
    finally:
        _LOCAL.unread = before


def outputs_unread_now() -> bool:
    return getattr(_LOCAL, "unread", False)
