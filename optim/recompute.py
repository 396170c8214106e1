"""Recompute only what memory requires: a checkpointed layer skips its recomputation while its
activations fit in the GPU memory the step leaves free.

Gradient checkpointing trades compute for memory on every layer, whatever the GPU has to spare:
each checkpointed layer runs its forward twice. Where the model's weights, the step's growth and
every layer's activations fit anyway, that second forward buys nothing. gpt-oss-20b with LoRA at
2048 tokens on an 80 GB GPU is the case: its 24 layers' activations take a few GiB beside 50 GiB of
weights, and the recompute is a third of the step.

How a step decides, with checkpointing on as the user set it (``gradient_checkpointing_enable``,
``TrainingArguments(gradient_checkpointing=True)``):

1. The first step with a backward runs every checkpointed layer as configured. It measures what
   the step grows above what was allocated at its start (its peak, read when its backward ends),
   and each layer's activations: the memory its recompute holds for the backward. CUDA's peak
   statistics are reset once, at that step's start, so the growth is the step's own; a reset by
   anyone else before its backward ends is seen, and the next step measures again.
2. Every later forward decides for its own batch, from its tokens, against what the process can
   still allocate (free device memory plus the caching allocator's unused blocks) less a headroom
   (5 % of the GPU, at least 1 GiB): the step's growth scaled by the tokens (never below what was
   measured), each layer's activations by the tokens up to the measured batch and by their square
   above it (attention that keeps a T x T matrix grows so). Layers skip their recompute, cheapest
   first, while they fit; the rest checkpoint as configured, and a layer measured at nothing
   (zero bytes) always does.

The math is the same either way (a recompute repeats the layer's forward), so losses and
gradients are those of plain checkpointing (with dropout, as long as the checkpoint preserves the
RNG state, transformers' default). Layers the model does not checkpoint, evaluation and
``torch.no_grad`` are untouched. A CUDA-graph capture records one step that every replay repeats:
it takes the decision of the eager forward just before it on the same tokens (``GraphedStep`` and
``GraphedTrainer`` run one, as torch asks, and empty the allocator's cache before capturing, so the
graph's own pool can take the memory that forward fitted in); a capture with no such forward keeps
every recompute. Every recompute stays: through ``optim.offload`` (memory first), on a model split
over devices (the layers off the measured device), and on a model with several stacks of
checkpointed layers (a vision tower beside the decoder). The decision reads only host-side
allocator counters: no device sync.

Switch ``recompute``: ``auto`` (the default: skip recompute where it fits, on CUDA), ``all`` (every
checkpointed layer recomputes: plain checkpointing).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from optim._hf import owner
from optim._memory import usable_and_total
from optim.switches import Switch, switches_of

log = logging.getLogger(__name__)

SWITCHES: dict[str, Switch] = switches_of("optim.recompute")

_ATTR = "_optim_recompute"
GIB = 2**30


class Memory:
    """The allocator counters a decision reads (CUDA's; a test passes its own)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def usable_and_total(self) -> tuple[int, int]:
        """What the process can still allocate (free plus the allocator's unused blocks), and what
        it may hold in all (the device's memory, or its per-process fraction of it)."""
        return usable_and_total(self.device)


MAX_ATTEMPTS = 3  # steps that may try to be the measured one (each resets CUDA's peak statistics)


def headroom(total: int) -> int:
    """Kept free beside the predicted peak: fragmentation, and batches that need a little more."""
    return max(GIB, int(0.05 * total))


def plan(acts: dict[int, int], growth: int, tokens: int, first_tokens: int, usable: int, total: int) -> frozenset[int]:
    """The layers that skip their recompute for a batch of ``tokens``: cheapest first, while the
    step's growth and their activations (both measured at ``first_tokens``) fit in ``usable`` less
    the headroom. The growth is scaled by the tokens, never below what was measured; activations by
    the tokens up to the measured batch and by their square above it (attention that keeps a
    T x T matrix grows so), so a longer batch than the measured one is judged conservatively."""
    scale = tokens / first_tokens
    room = usable - growth * max(1.0, scale) - headroom(total)
    act_scale = scale if scale <= 1 else scale * scale
    skip = []
    for idx, act in sorted(acts.items(), key=lambda kv: (kv[1], kv[0])):
        room -= act * act_scale
        if room < 0:
            break
        skip.append(idx)
    return frozenset(skip)


@dataclass
class RecomputeState:
    """Per model: what the first step measured and what each forward decided."""

    mode: str
    layers: int = 0
    memory: Callable[[torch.device], Any] = Memory  # a test passes a fake
    first_tokens: int | None = None  # the measured step's tokens
    start_allocated: int = 0  # allocated at the measured step's start
    growth: int | None = None  # the measured step's peak above its start
    acts: dict[int, int] = field(default_factory=dict)  # layer index -> activation bytes at first_tokens
    measuring: bool = False
    measured_forward: int = -1
    forwards: int = 0
    decided_for: int = -1
    decided_tokens: int | None = None  # the tokens the last planned (eager) forward decided for
    skip: frozenset = frozenset()
    skipped: dict[str, int] = field(default_factory=lambda: {"last": 0, "min": -1, "max": 0})
    recomputed: int = 0  # recomputes run since enable (a skipped layer runs none)
    peak_reset: bool = False
    inactive: str = ""  # why the module keeps every recompute for this model, where it does
    attempts: int = 0  # steps started as the measured one
    mem: Any = None

    def begin(self, tokens: int, device: torch.device) -> None:
        """The first checkpointed layer call of a forward: measure (the first step with a
        backward) or decide."""
        self.decided_for = self.forwards
        if self.mem is None:
            self.mem = self.memory(device)
        if _capturing(device):
            # the graph's pool is not the cached blocks the counters describe, and the captured
            # step is every replay's: the eager forward just before, on the same tokens, decided
            # for it (its skip stands); with none (nothing measured yet, other tokens), recompute all
            if self.growth is None or self.measuring or tokens != self.decided_tokens:
                self.skip = frozenset()
            if self.measuring:  # a measured forward whose backward never ran: the capture's is not it
                self.measuring, self.attempts = False, max(0, self.attempts - 1)
            return
        if self.growth is None:  # measure this step (again, where the last measured forward had no backward)
            self.skip, self.decided_tokens = frozenset(), None
            self._start_measuring(tokens)
            return
        usable, total = self.mem.usable_and_total()
        self.skip = plan(self.acts, self.growth, tokens, self.first_tokens, usable, total)
        self.decided_tokens = tokens
        n = len(self.skip)
        self.skipped["last"], self.skipped["max"] = n, max(self.skipped["max"], n)
        self.skipped["min"] = n if self.skipped["min"] < 0 else min(self.skipped["min"], n)

    def _start_measuring(self, tokens: int) -> None:
        self.attempts += 1
        if self.attempts > MAX_ATTEMPTS:  # no backward recomputed anything measurable: leave it be
            self.inactive = f"nothing measured in {MAX_ATTEMPTS} steps: every recompute kept"
            self.measuring = False
            return
        # a backward that raised (an out-of-memory error a batch-size search catches) never ran its
        # end-of-backward callback: the flag it left would keep every later step from measuring
        self._queued = False
        self.measuring, self.measured_forward, self.first_tokens, self.acts = True, self.forwards, tokens, {}
        self.start_allocated = self.mem.allocated()
        if self.mem.peak() > self.start_allocated:  # an earlier computation's peak: not this step's
            self.mem.reset_peak()
            self.peak_reset = True

    def backward_started(self) -> None:
        """The measured step's first recompute: its peak is read when this backward ends."""
        if self.measuring and not getattr(self, "_queued", False):
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._queued = False
        if not self.measuring:
            return
        peak = self.mem.peak()
        if not self.acts or peak < self.start_allocated + max(self.acts.values()):
            self.measuring = False  # the peak was reset meanwhile: measure the next step again
            return
        self.growth, self.measuring = peak - self.start_allocated, False


class BudgetedCheckpoint:
    """A layer's checkpoint function: the configured one (``__wrapped__``), measured in the first
    step, skipped where the forward's decision says the layer's activations fit."""

    def __init__(self, state: RecomputeState, index: int, inner: Callable):
        self.state, self.index, self.__wrapped__ = state, index, inner

    def __call__(self, fn, *args, **kwargs):
        st = self.state
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not _active(st, x, self.__wrapped__):
            return self.__wrapped__(fn, *args, **kwargs)
        if st.decided_for != st.forwards:
            st.begin(int(x.shape[:-1].numel()), x.device)
        if self.index in st.skip:
            return fn(*args, **kwargs)
        counted = self._counted(fn)
        if not st.measuring:
            return self.__wrapped__(counted, *args, **kwargs)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # the recompute runs whole
            return self.__wrapped__(counted, *args, **kwargs)

    def _counted(self, fn):
        st, index, calls = self.state, self.index, [0]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:  # the forward
                return fn(*args, **kwargs)
            st.recomputed += 1
            if not st.measuring:
                return fn(*args, **kwargs)
            st.backward_started()
            before = st.mem.allocated()
            out = fn(*args, **kwargs)
            held = st.mem.allocated() - before  # what the backward holds of it
            if held > 0:  # nothing measured (frees elsewhere): unknown, so never skipped
                st.acts[index] = held
            return out
        return run


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _active(st: RecomputeState, x: torch.Tensor, inner) -> bool:
    """Whether this call is the module's to decide: auto, not through optim.offload, a backward
    to come (grad on), and on the device the first step measured (one device per model)."""
    if st.mode != "auto" or st.inactive or type(inner).__name__ == "Offloader" or not torch.is_grad_enabled():
        return False
    if st.mem is not None and getattr(st.mem, "device", x.device) != x.device:
        return False  # a model split over devices: its other devices' layers keep their recompute
    return x.device.type == "cuda" or st.memory is not Memory


def _layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _wrap(st: RecomputeState, layers: list[nn.Module]) -> None:
    """Each checkpointing layer's function wrapped (again, where transformers set a new one since)."""
    for i, layer in enumerate(layers):
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is not None and not (isinstance(fn, BudgetedCheckpoint) and fn.state is st):
            while isinstance(fn, BudgetedCheckpoint):  # another enable's wrapper: the configured function
                fn = fn.__wrapped__
            layer._gradient_checkpointing_func = BudgetedCheckpoint(st, i, fn)


def _stacks(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The modules whose forward runs the decoder layers (each holds a ModuleList of them)."""
    ids = {id(m) for m in layers}
    out = [m for m in model.modules()
           if any(isinstance(c, nn.ModuleList) and any(id(x) in ids for x in c) for c in m.children())]
    return out or [owner(model)]


def enable(model: nn.Module, *, recompute: str | None = None, _memory=None, **_ignored) -> nn.Module:
    """Skip the recompute of checkpointed layers whose activations fit (``recompute``, or
    OPTIM_RECOMPUTE: auto, all). Works whenever checkpointing is turned on, before or after this
    call. Returns the model."""
    mode = SWITCHES["recompute"].resolve(recompute)
    disable(model)
    st = RecomputeState(mode=mode, memory=_memory or Memory)
    layers = _layers(model)
    st.layers = len(layers)
    vars(owner(model))[_ATTR] = st
    if mode == "all" or not layers:
        return model

    def before_forward(_module, _args):
        st.forwards += 1
        _wrap(st, layers)  # a later gradient_checkpointing_enable sets new functions

    stacks = _stacks(model, layers)
    if len(stacks) > 1:  # a vision tower beside the decoder: one budget cannot judge both stacks' tokens
        st.inactive = f"{len(stacks)} stacks of checkpointed layers: every recompute kept"
        return model
    st.hook = stacks[0].register_forward_pre_hook(before_forward)
    _wrap(st, layers)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: every layer's configured checkpoint function, no hook."""
    st = vars(owner(model)).pop(_ATTR, None)
    if st is None:
        return model
    hook = getattr(st, "hook", None)
    if hook is not None:
        hook.remove()
    for layer in _layers(model):
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if isinstance(fn, BudgetedCheckpoint) and fn.state is st:
            layer._gradient_checkpointing_func = fn.__wrapped__
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    """What the steps so far decided (empty when not applied)."""
    st = vars(owner(model)).get(_ATTR)
    if st is None:
        return {}
    d = {"recompute": st.mode, "layers": st.layers, "layers_skipped": dict(st.skipped),
         "recomputes": st.recomputed}
    if st.inactive:
        d["inactive"] = st.inactive
    if st.growth is not None:
        d.update(measured_tokens=st.first_tokens, allocated_at_start_gib=round(st.start_allocated / GIB, 3),
                 step_growth_gib=round(st.growth / GIB, 3),
                 activation_gib_per_layer=round(max(st.acts.values(), default=0) / GIB, 4),
                 peak_reset=st.peak_reset)
    return d


def run_stats(model: nn.Module) -> dict[str, Any]:
    """What the steps so far decided, for a results row."""
    return {"recompute_stats": describe(model) or None}
