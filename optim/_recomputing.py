"""Which layer's recompute is running, where its outputs are read by nobody.

``optim.offload`` recomputes a checkpointed layer in its backward only to rebuild what the
layer's backward needs: the recomputed outputs are the roots ``torch.autograd.backward`` starts
from, and their values are read by nothing. A module whose output reaches that layer's output only
through a residual add (whose backward reads no values) may then skip computing it, as long as it
saves what its own backward needs. ``optim.mlp`` does so for its chunked MLP in Llama-shaped
decoder layers, and only when the module recomputed is that very layer: in a checkpointed block of
two layers the first one's output is read by the second, so nothing is skipped.

The state is thread-local: autograd runs a device's backward on one thread, and the recompute's
forward runs on that thread, inside the ``with``.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

from torch import nn

_LOCAL = threading.local()


_CALLS = ("forward", "__call__", "_call_impl", "_wrapped_call_impl")


def _own_call(module: nn.Module, func) -> bool:
    """Whether ``func`` is ``module``'s forward or call as its class defines it (or a function
    one of its wrappers wraps): a callable that also does something with the module's output is not."""
    name = getattr(func, "__name__", None)
    if name not in _CALLS:
        return False
    for cls in type(module).__mro__:
        own = vars(cls).get(name)
        for _ in range(16):  # the function, then each one it wraps (decorators, checkpointing)
            if own is None:
                break
            if own is func:
                return True
            own = getattr(own, "__wrapped__", None)
    return False


def _runs(func):
    """A bound method marked ``_optim_runs = "attr"`` runs ``self.attr`` with its own arguments
    (``optim.regional``'s compiled checkpoint body): that callable, else ``func`` itself."""
    target = getattr(getattr(func, "__func__", None), "_optim_runs", None)
    return getattr(func.__self__, target) if target else func


def module_of(function) -> nn.Module | None:
    """The module whose call alone a checkpointed callable is: the module itself, its bound call or
    forward, or a ``functools.partial`` of one, or of its class's forward with the module as first
    argument (transformers' checkpointed layers, by version); else None."""
    while isinstance(function, functools.partial):
        head = function.args[0] if function.args else None
        func = _runs(function.func)
        if isinstance(head, nn.Module) and not hasattr(func, "__self__"):
            return head if len(function.args) == 1 and _own_call(head, func) else None
        if function.args:
            return None  # positional arguments bound before the layer's own: not a plain call
        function = function.func
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) and _own_call(owner, getattr(function, "__func__", None)) else None


@contextmanager
def outputs_unread(module: nn.Module | None):
    """Mark the code inside as ``module``'s recompute, its outputs only rooting a backward (None:
    an unknown callable, where nothing may be skipped)."""
    before = getattr(_LOCAL, "module", None)
    _LOCAL.module = module
    try:
        yield
    finally:
        _LOCAL.module = before


def unread_module() -> nn.Module | None:
    """The module whose recompute is running with its outputs unread, else None."""
    return getattr(_LOCAL, "module", None)
