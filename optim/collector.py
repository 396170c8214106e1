"""Python's cycle collector kept out of the training step (switch ``gc_threshold``).

A training step of a Hugging Face model makes many thousands of objects that CPython's cycle
collector tracks: the tensors, the dicts and tuples of every module call, and, under non-reentrant
checkpointing, a holder, a weak reference and a dict for each tensor a layer saves. CPython starts a
young collection every ``gc.get_threshold()[0]`` net allocations (700 by default through 3.13), so a
step runs many of them. Each one finds the forward's saved objects still alive and promotes them, and once
the promoted objects outnumber a quarter of the long-lived heap, a full collection follows. In a
process that has imported transformers and built a model, that heap holds hundreds of thousands of
objects, and a full collection walks all of them. Where the step is host-bound (MoE models, small models, a few
thousand tokens), the GPU waits for every one of those pauses.

``gc_threshold=N`` raises the young generation's threshold to N net allocations, so a step's objects
die by reference count before a collection looks at them: few are promoted, and full collections
become rare (``tests/test_collector.py`` counts the collections of each step in a real loop). The older generations'
thresholds stay as they were. Cyclic garbage is still collected, just later: a step makes little
of it (the closures of pytree's ``tree_flatten``, which hold no tensors). Nothing is frozen, since
a frozen model's reference cycles would never be collected after ``del model``.

The switch is off by default. With ``compile_layers`` on (the default on CUDA) a decoder layer's
forward is one compiled graph that makes few objects, so a GPU step runs few collections, and the
raise measured no step-time gain there (docs/optim.md). Where layers run eagerly (on a CPU, or
``compile_layers=off``) a step collects often, and the raise keeps those collections out of it.

An enabled model, like a compiled one, holds reference cycles, so ``del model`` frees it only at
the next full collection, and a raised threshold makes those rarer. So the first model to raise the
threshold runs one full collection first, which frees a model deleted before it. To free a model's
GPU memory at once, call ``gc.collect()`` after ``del model``, as with any such model.

The collector belongs to the whole process. ``enable`` only raises the threshold: a larger one the
process set, or a disabled collector (``gc.disable()`` or a young threshold of 0), stays as it is.
With several enabled models the largest request holds. When the last of them is disabled or
garbage-collected, the thresholds go back to what the process had; a setting the process makes
meanwhile is its own from then on, kept, never overwritten. A deep copy of an enabled model holds
no raise of its own until it is enabled.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from torch import nn

from optim._hf import owner
from optim.switches import switches_of

SWITCHES = switches_of(__name__)

_ATTR = "_optim_collector"
_held: dict[int, tuple[weakref.finalize, int]] = {}  # per owner id: its finalizer and the threshold it asks
_found: tuple[int, ...] | None = None  # the process's thresholds under the raise
_set: tuple[int, ...] | None = None  # the thresholds the raise last set


def _apply() -> None:
    """Set the young threshold the holders ask (never below the process's own), or put back the
    process's thresholds when none is left; a setting the process made since the last raise is
    its own from then on, kept and raised from, never overwritten."""
    global _found, _set
    now = gc.get_threshold()
    if _set is not None and now != _set:
        _found = now
    if not _held:
        if _found is not None and now == _set:
            gc.set_threshold(*_found)
        _found = _set = None
        return
    if _found is None:
        _found = now
    want = max(v for _, v in _held.values())
    # a young threshold of 0 is the process turning automatic collection off: it stays off
    target = _found if _found[0] == 0 else (max(want, _found[0]), *_found[1:])
    if target != now:
        gc.set_threshold(*target)
    _set = gc.get_threshold()


def _release(key: int) -> None:
    held = _held.pop(key, None)
    if held is not None:
        held[0].detach()
        _apply()


def enable(model: nn.Module, *, gc_threshold: Any = None, **_ignored) -> nn.Module:
    """Raise the cycle collector's young threshold (``gc_threshold``, or OPTIM_GC_THRESHOLD) for
    as long as ``model`` is enabled. Returns the model."""
    value = SWITCHES["gc_threshold"].resolve(gc_threshold)
    own = owner(model)
    key = id(own)
    held = _held.pop(key, None)  # a second enable replaces the first's request
    if held is not None:
        held[0].detach()
    state: dict[str, Any] = {"gc_threshold": value}
    vars(own)[_ATTR] = state
    now = gc.get_threshold()
    if value == "off":
        state["reason"] = "left as it is (gc_threshold=off)"
    elif not gc.isenabled() or now[0] == 0:
        state["reason"] = f"disabled by the process (enabled: {gc.isenabled()}, thresholds {now}): left as it is"
    else:
        if _found is None and not _held:
            # An enabled model holds reference cycles (its rebound forwards, torch.compile's
            # wrappers), so a deleted one is freed by a full collection, which a raised threshold
            # makes rarer: one now returns an earlier model's memory before this one trains.
            gc.collect()
        _held[key] = (weakref.finalize(own, _release, key), value)
    _apply()
    return model


def disable(model: nn.Module) -> nn.Module:
    """Let go of the raise; the last model to let go puts back the thresholds found. Returns the model."""
    own = owner(model)
    vars(own).pop(_ATTR, None)
    _release(id(own))
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    """The switch's value and what the collector runs with now, read at this call."""
    own = owner(model)
    state = vars(own).get(_ATTR)
    if state is None:
        return {}
    now = gc.get_threshold()
    if id(own) not in _held:
        said = state.get("reason") or "holds no raise (a copy of an enabled model: optim.enable(copy) makes it hold one)"
    elif _found is not None and now != _found:
        said = f"thresholds {now}, raised from {_found}"
    else:
        said = f"thresholds {now} set by the process, young >= {state['gc_threshold']}: left as they are"
    return {"gc_threshold": state["gc_threshold"], "collector": said}
