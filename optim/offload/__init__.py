"""Checkpointed layer inputs offloaded to pinned host memory, reloaded double-buffered.

    import optim.offload
    model = optim.offload.enable(model, offload="double")   # transformers model, peft or not
    loss.backward(); optim.offload.get(model).stats()        # bytes offloaded, c and g if profiled

    off = optim.offload.Offloader("double")                  # standalone, like torch.utils.checkpoint
    y = off(block, x)                                        # or optim.offload.checkpoint(block, x, offloader=off)

Gradient checkpointing keeps one input per decoder layer alive on the GPU until the backward.
Here that input is copied, on a side CUDA stream, into a persistent pinned host buffer (one per
"slot", sized on the first step and reused) and the GPU copy is released. In the backward the
input is copied back into a GPU *staging* buffer, the layer is recomputed under grad mode and
backpropagated (the reentrant-checkpoint recipe, made robust: see ``_OffloadFunction``).

Modes (switch ``offload``, env ``OPTIM_OFFLOAD``):

- ``none``: plain GPU checkpointing (``torch.utils.checkpoint``, non-reentrant). Baseline.
- ``single``: one staging buffer; each layer's backward issues its reload, waits, computes. The
  copy and the compute take turns: T ≈ L·(c + g).
- ``double``: two staging buffers. Before layer i's recompute starts, the reload of layer i−1 is
  issued on the copy stream into the other buffer (explicit one-layer-ahead prefetch), so the
  copy hides behind layer i's compute: T ≈ c + (L−1)·max(c, g) + g. Events order every reuse of a
  staging buffer after the compute that last read it, and a newly allocated buffer's first copy
  after the compute-stream work queued before its allocation (``_ensure_staging``).
- ``save_on_cpu``: the peer, PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
  around non-reentrant checkpointing (what ``gradient_checkpointing_enable(offload=True)`` does in
  transformers 5.17): a fresh pinned buffer per tensor per step, copies on the compute stream.

What is offloaded: the first positional tensor argument of each checkpointed call (a decoder
layer's ``hidden_states``), when it has at least ``min_bytes`` bytes and is not a leaf that
requires grad (autograd holds such a leaf until the backward, so a host copy frees nothing: in a
transformers model with LoRA that is the first layer's input, the embedding output). Nothing else
may hold the input either: the recompute closure keeps only the non-tensor arguments. The offload of a layer's
input is issued when the *next* checkpointed layer starts its forward; the last layer never sees
a next one, so its input stays on the GPU, which is right: its backward runs first and would
reload it at once. Other tensor arguments (and keyword tensors, e.g. masks and rotary tables
shared by every layer) stay where they are.

Memory guard (switch ``offload_guard``): the second staging buffer is allocated only when the
memory the process can still allocate covers the step's peak growth, the buffer and a headroom
(see ``Offloader._guard_ok``); otherwise ``double`` falls back to ``single``. If a pinned host
buffer or the first staging buffer cannot be had, the mode falls back to ``none`` (inputs stay
on the GPU). One log line on logger ``optim.offload`` per fallback. Allocations happen only in the first step (or when
a larger batch arrives), are caught on failure, and each replaces at least one layer input on
the GPU, so the guard itself never causes an OOM.

Without CUDA (CPU tensors) there are no streams or events: the same slots, staging buffers,
prefetch order and recompute run synchronously, which is what the CPU tests exercise.

Layout: ``offloader`` (the ``Offloader`` and the switches), ``function`` (the autograd function
and its per-call records); this module holds the entry points ``enable``, ``get`` and ``checkpoint``.

Only torch is imported here (transformers is used through the model object you pass in).
"""

from __future__ import annotations

import functools
import types

from optim.offload.function import StepStats
from optim.offload.offloader import DEFAULT_MIN_BYTES, MODES, SWITCHES, Offloader, log

__all__ = ["DEFAULT_MIN_BYTES", "MODES", "SWITCHES", "Offloader", "StepStats", "checkpoint", "disable", "enable", "get", "run_stats"]


_DEFAULT: Offloader | None = None


def checkpoint(function, *args, offloader: Offloader | None = None, **kwargs):
    """Standalone use, like ``torch.utils.checkpoint.checkpoint(function, *args)``. Without an
    ``offloader``, a module-wide one in the mode of the ``offload`` switch (env) is used."""
    global _DEFAULT
    if offloader is None:
        if _DEFAULT is None:
            _DEFAULT = Offloader(SWITCHES["offload"].resolve(),
                                 guard=SWITCHES["offload_guard"].resolve())
        offloader = _DEFAULT
    return offloader(function, *args, **kwargs)


_ATTR = "_optim_offloader"


def enable(
    model,
    offload: str | None = None,
    offload_guard: bool | None = None,
    offload_profile: bool | None = None,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    headroom_bytes: int | None = None,
    profile: bool | None = None,
):
    """Turn gradient checkpointing on in a transformers model (peft-wrapped or not), every
    checkpointed layer going through an ``Offloader``. Returns the model; ``get(model)`` returns
    the offloader (its ``stats()``). Calling it again replaces the previous offloader.
    ``offload_profile`` (``profile`` is its older name) times each reload and each layer's
    backward with CUDA events: ``stats()`` then gives ``reload_ms`` and ``backward_ms``."""
    mode = SWITCHES["offload"].resolve(offload)
    guard = SWITCHES["offload_guard"].resolve(offload_guard)
    profile = SWITCHES["offload_profile"].resolve(offload_profile if offload_profile is not None else profile)
    base = _hf_model(model)
    old = vars(base).get(_ATTR)
    if old is not None:
        old.close()
    if _SAVED not in vars(base):  # checkpointing as it was before the first enable, for disable()
        object.__setattr__(base, _SAVED, _checkpointing_state(base))
    off = Offloader(mode, guard=guard, min_bytes=min_bytes, headroom_bytes=headroom_bytes,
                    profile=profile)
    # Enabling checkpointing also makes the embeddings' output require grad (peft needs it); then
    # every GradientCheckpointingLayer gets our function, called as f(layer_call, *args). A later
    # enable (Trainer's gradient_checkpointing=True calls it again) keeps the offloader.
    _keep_offloader(base)
    object.__setattr__(base, _ATTR, off)
    enable_checkpointing = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.23
    object.__setattr__(base, "_optim_offload_own_call", True)  # ours: nothing to tell
    try:
        if enable_checkpointing is not None:
            enable_checkpointing(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    finally:
        object.__setattr__(base, "_optim_offload_own_call", False)
    return model


def disable(model):
    """Undo ``enable``: checkpointing as it was before (off, or on with its own function), no
    offloader, its pinned and staging buffers released. A model it never enabled is left as is."""
    off = get(model)
    if off is None:
        return model
    off.close()
    base = _hf_model(model)
    saved = vars(base).pop(_SAVED)
    for attr in (_ATTR, "_optim_offload_own_call", "_optim_offload_told"):
        vars(base).pop(attr, None)
    current = vars(base).get("_set_gradient_checkpointing")
    if getattr(current, "__func__", None) is _set_gradient_checkpointing:  # ours: the setter as it was before
        prev = vars(base).pop(_PREV_SET, None)
        if prev is None:
            vars(base).pop("_set_gradient_checkpointing")
        else:
            object.__setattr__(base, "_set_gradient_checkpointing", prev)
    # else a wrapper around ours, set since: it stays, and ours passes its calls through unchanged
    flags, hooks, attrs = saved
    for m, (on, func) in flags.items():
        m.gradient_checkpointing = on
        if func is _MISSING:
            vars(m).pop("_gradient_checkpointing_func", None)
        else:
            m._gradient_checkpointing_func = func
    # each enabling of checkpointing hooked the input embeddings once more: those hooks go, others stay
    for m in base.modules():
        for key, hook in list(m._forward_hooks.items()):
            if key not in hooks.get(m, ()) and getattr(hook, "__name__", "") == "make_inputs_require_grads":
                for d in (m._forward_hooks, m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                    d.pop(key, None)
    for name, value in attrs.items():
        if value is _MISSING:
            vars(base).pop(name, None)
        else:
            vars(base)[name] = value
    return model


_SAVED = "_optim_offload_saved"
_MISSING = object()
_PREV_SET = "_optim_offload_prev_set"  # another library's _set_gradient_checkpointing on the model, kept
_HOOK_ATTRS = ("_require_grads_hook", "_require_grads_hooks")  # transformers' record of those hooks


def _checkpointing_state(base):
    """Each module's checkpointing flag and function, the forward hooks there were, and
    transformers' record of the embeddings' require-grad hooks (what enabling checkpointing adds)."""
    flags = {m: (m.gradient_checkpointing, vars(m).get("_gradient_checkpointing_func", _MISSING))
             for m in base.modules() if hasattr(m, "gradient_checkpointing")}
    hooks = {m: set(m._forward_hooks) for m in base.modules() if m._forward_hooks}
    attrs = {name: (list(v) if isinstance(v := vars(base).get(name, _MISSING), list) else v) for name in _HOOK_ATTRS}
    return flags, hooks, attrs


def _keep_offloader(base) -> None:
    """Route every later ``_set_gradient_checkpointing(enable=True, ...)`` of ``base`` (what
    ``gradient_checkpointing_enable`` and ``activation_checkpointing_enable`` call, with
    transformers' own checkpoint function) through the model's offloader, so that
    ``Trainer(args.gradient_checkpointing=True)`` does not silently undo ``optim.offload``."""
    if _PREV_SET in vars(base):
        return  # routed by an earlier enable (ours, or a wrapper around ours set since): it reads the new offloader
    current = vars(base).get("_set_gradient_checkpointing")
    # another library's, set on this model before us: ours calls it, with the offloader (None: the class's)
    object.__setattr__(base, _PREV_SET, current)
    # a method bound to base, not a closure over it: a deep copy's (TRL's reference model, an EMA
    # copy) is bound to the copy, so the copy's checkpointing calls set the copy's layers
    object.__setattr__(base, "_set_gradient_checkpointing", types.MethodType(_set_gradient_checkpointing, base))


def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
    """The model's ``_set_gradient_checkpointing`` (the class's, or the one another library set on
    the model before optim.offload) with its offloader as the checkpoint function."""
    prev = vars(self).get(_PREV_SET)
    stock = functools.partial(type(self)._set_gradient_checkpointing, self) if prev is None else prev
    off = vars(self).get(_ATTR)
    if not enable:
        return stock(enable=False)
    if off is None:  # reached after disable, through a wrapper someone set around ours: their call, unchanged
        func = {} if gradient_checkpointing_func is None else {"gradient_checkpointing_func": gradient_checkpointing_func}
        return stock(enable=True, every_n_layers=every_n_layers, **func)
    if gradient_checkpointing_func is not None and gradient_checkpointing_func is not off \
            and not getattr(self, "_optim_offload_own_call", False) \
            and not getattr(self, "_optim_offload_told", False):
        log.info("optim.offload: checkpointing enabled again (Trainer's gradient_checkpointing=True?); "
                 "the layers keep optim.offload (%s) instead of %r", off.requested_mode,
                 getattr(gradient_checkpointing_func, "func", gradient_checkpointing_func))
        object.__setattr__(self, "_optim_offload_told", True)
    return stock(enable=True, gradient_checkpointing_func=off, every_n_layers=every_n_layers)


def run_stats(model) -> dict:
    """What offload did in the steps so far, for a results row: the offloader's buffer and copy
    statistics (None where the model has no offloader)."""
    off = get(model)
    return {"offload_stats": off.stats() if off is not None else None}


def get(model) -> Offloader | None:
    """The model's offloader (kept on the transformers model under any wrapper), or None."""
    try:
        return vars(_hf_model(model)).get(_ATTR)
    except TypeError:
        return None


def _hf_model(model):
    # The transformers PreTrainedModel inside (peft's wrappers forward attributes but do not
    # define these methods on their class).
    for m in model.modules():
        if getattr(type(m), "_set_gradient_checkpointing", None) is not None and \
                getattr(type(m), "gradient_checkpointing_enable", None) is not None:
            return m
    raise TypeError(f"{type(model).__name__} holds no transformers model with gradient checkpointing")
