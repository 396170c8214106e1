"""Python's cycle collector kept out of the training step (switch ``gc_threshold``).

A training step of a Hugging Face model makes tens of thousands of objects that CPython's cycle
collector tracks: the tensors, the dicts and tuples of every module call, and, under non-reentrant
checkpointing, a holder, a weak reference and a dict for each tensor a layer saves. CPython starts a
young collection every 700 net allocations (``gc.get_threshold()[0]``), so a step runs dozens to
hundreds of them. Each one finds the forward's saved objects still alive and promotes them, and once
the promoted objects outnumber a quarter of the long-lived heap, a full collection follows. In a
process that has imported transformers and built a model, that heap holds hundreds of thousands of
objects, and a full collection walks all of them. Where the step is host-bound (MoE models, small models, a few
thousand tokens), the GPU waits for every one of those pauses.

``gc_threshold=N`` raises the young generation's threshold to N net allocations, so a step's objects
die by reference count before a collection looks at them. Then nothing is promoted and no full
collection comes (``tests/test_collector.py`` counts both in a real loop). The older generations'
thresholds stay as they were. Cyclic garbage is still collected, just later: a step makes little
of it (the closures of pytree's ``tree_flatten``, which hold no tensors). Nothing is frozen, since
a frozen model's reference cycles would never be collected after ``del model``.

An enabled model, like a compiled one, holds reference cycles, so ``del model`` frees it only at
the next full collection, and a raised threshold makes those rarer. So the first model to raise the
threshold runs one full collection first, which frees a model deleted before it. To free a model's
GPU memory at once, call ``gc.collect()`` after ``del model``, as with any such model.

The collector belongs to the whole process. ``enable`` only raises the threshold: a larger one the
user set, or a disabled collector, stays as it is. When the last enabled model is disabled or
garbage-collected, the thresholds go back to what the first ``enable`` found, unless something else
has changed them since.
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
_held: dict[int, weakref.finalize] = {}  # the models holding the raise, by id of their owner
_found: tuple[int, int, int] | None = None  # the thresholds before the first raise
_raised_to: int | None = None  # the young threshold as the raise left it


def _release(key: int) -> None:
    """``key``'s model lets go; the last one puts back the thresholds the first raise found."""
    global _found, _raised_to
    fin = _held.pop(key, None)
    if fin is not None:
        fin.detach()
    if _held or _found is None:
        return
    if gc.get_threshold()[0] == _raised_to:  # else someone set their own since: theirs stays
        gc.set_threshold(*_found)
    _found = _raised_to = None


def enable(model: nn.Module, *, gc_threshold: Any = None, **_ignored) -> nn.Module:
    """Raise the cycle collector's young threshold (``gc_threshold``, or OPTIM_GC_THRESHOLD) for
    as long as ``model`` is enabled. Returns the model."""
    global _found, _raised_to
    value = SWITCHES["gc_threshold"].resolve(gc_threshold)
    disable(model)
    own = owner(model)
    state = {"gc_threshold": value}
    vars(own)[_ATTR] = state
    if value == "off":
        state["collector"] = "left as it is (gc_threshold=off)"
        return model
    if not gc.isenabled():
        state["collector"] = "disabled by the process: left as it is"
        return model
    now = gc.get_threshold()
    if now[0] >= value and now[0] != _raised_to:
        state["collector"] = f"thresholds {now} set by the process, young {now[0]} >= {value}: left as they are"
        return model
    if not _held:
        # An enabled model holds reference cycles (its rebound forwards, torch.compile's wrappers),
        # so a deleted one is freed by a full collection, which a raised threshold makes rarer:
        # one now returns an earlier model's memory before this one trains.
        gc.collect()
    if _found is None:
        _found = now
    if now[0] < value:
        gc.set_threshold(value, *now[1:])
    _raised_to = gc.get_threshold()[0]
    _held[id(own)] = weakref.finalize(own, _release, id(own))
    state["collector"] = f"thresholds {gc.get_threshold()}, raised from {_found}"
    return model


def disable(model: nn.Module) -> nn.Module:
    """Let go of the raise; the last model to let go puts back the thresholds found. Returns the model."""
    own = owner(model)
    vars(own).pop(_ATTR, None)
    if id(own) in _held:
        _release(id(own))
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    return dict(vars(owner(model)).get(_ATTR, {}))
