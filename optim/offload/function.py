"""The autograd function every offloaded layer call goes through (the reentrant-checkpoint
recipe: it saves only the layer input, which the offloader may move to the host, and recomputes
the layer in its backward), and the per-call record and per-step statistics it keeps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from optim._recomputing import module_of, outputs_unread

if TYPE_CHECKING:
    from optim.offload.offloader import Offloader


class Record:
    """One checkpointed call's layer input: where it lives between forward and backward."""

    __slots__ = ("rid", "pos", "slot", "x", "nbytes", "shape", "dtype", "device", "requires_grad",
                 "state", "buf", "loaded_evt", "__weakref__")

    def __init__(self, rid: int, pos: int, x: torch.Tensor):
        self.rid = rid
        self.pos = pos  # index in the forward order of its step
        self.slot: int | None = None  # host buffer slot once offloaded
        self.x: torch.Tensor | None = x  # the GPU tensor while it is still held
        self.nbytes = x.numel() * x.element_size()
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.requires_grad = x.requires_grad
        # kept: x stays on device; pending: waits for the next layer to offload it;
        # offloaded: on the host; loaded: in staging buffer ``buf``; done: backward finished
        self.state = "pending"
        self.buf: int | None = None
        self.loaded_evt = None


@dataclass
class StepStats:
    """One step's offload bookkeeping. Timings are filled only with ``profile=True``."""

    mode: str
    layers: int = 0  # checkpointed calls in the forward
    offloaded: int = 0
    bytes_per_layer: list[int] = field(default_factory=list)  # offloaded inputs, forward order
    kept_small: int = 0  # below min_bytes
    kept_last: int = 0  # never followed by another layer before the backward
    kept_leaf: int = 0  # a grad-requiring leaf: autograd holds it anyway
    prefetched: int = 0  # reloads issued one layer ahead that were used as issued
    demand_loads: int = 0  # reloads issued by the layer that needed them
    backward_layers: int = 0
    # profile: per reload (c) and per layer backward = recompute + backprop (g), in backward order
    _reload_events: list = field(default_factory=list)
    _compute_events: list = field(default_factory=list)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["bytes_offloaded"] = sum(self.bytes_per_layer)
        out["reload_ms"] = [_elapsed_ms(a, b) for a, b in self._reload_events]
        out["backward_ms"] = [_elapsed_ms(a, b) for a, b in self._compute_events]
        return out


def _elapsed_ms(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e3
    b.synchronize()
    return a.elapsed_time(b)


def split_args(args: tuple) -> tuple[list[torch.Tensor], Callable[[list], list]]:
    """Positional tensors go through autograd (they get grads); the rest stay in a closure."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in idx]
    # The closure must not hold the tensors themselves: it lives until the backward, and keeping
    # the layer input alive in it would make offloading free nothing.
    template = [None if isinstance(a, torch.Tensor) else a for a in args]

    def rebuild(ts):
        out = list(template)
        for i, t in zip(idx, ts):
            out[i] = t
        return out

    return tensors, rebuild


def _autocast_state(device_type: str) -> tuple:
    return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


class OffloadFunction(torch.autograd.Function):
    """Forward without grad, remembering only the inputs (the first one offloaded); backward
    reloads it, recomputes under grad mode and backpropagates through the recomputed graph.

    Reentrant checkpointing's known gaps are closed: the output always requires grad (an anchor
    input), RNG state and autocast state are replayed, and parameter grads accumulate as usual.
    One stays: the layer's parameters are not inputs of this node, so a backward restricted to
    some leaves (``loss.backward(inputs=...)``, ``torch.autograd.grad``) cannot reach them through
    it. Such a backward that runs this node raises (``_restricted``) rather than leave gradients
    silently missing or accumulate into ``.grad`` behind ``autograd.grad``'s back.
    """

    @staticmethod
    def forward(fctx, mgr: Offloader, function, kwargs, rebuild, preserve, anchor, *tensors):
        fctx.mgr, fctx.function, fctx.kwargs, fctx.rebuild = mgr, function, kwargs, rebuild
        fctx.preserve = preserve
        fctx.anchor = anchor  # a leaf of its own: not saved, and never modified
        device_type = tensors[0].device.type if tensors else "cpu"
        fctx.device_type = device_type
        fctx.autocast = _autocast_state(device_type)
        if preserve:
            fctx.cpu_rng = torch.get_rng_state()
            fctx.rng_devices, fctx.rng_states = get_device_states(*tensors)
        with torch.no_grad():
            out = function(*rebuild(list(tensors)), **kwargs)
        # The first tensor is the layer input: held by the record (and offloaded once the next
        # layer starts). The others are saved as usual.
        fctx.record = mgr._on_forward(tensors[0] if tensors else None)
        fctx.save_for_backward(*tensors[1:])
        fctx.first_requires_grad = bool(tensors) and tensors[0].requires_grad
        return out

    @staticmethod
    def backward(fctx, *grad_outputs):
        mgr: Offloader = fctx.mgr
        rec: Record | None = fctx.record
        if _restricted(fctx.anchor):
            raise RuntimeError(
                "optim.offload: this backward is restricted to some leaves (loss.backward(inputs=...) or "
                "torch.autograd.grad), which an offloaded layer cannot serve: its parameters' gradients "
                "would be missing. Call loss.backward(), or enable with offload='none'.")
        rest = fctx.saved_tensors
        first = [mgr._acquire(rec)] if rec is not None else []
        inputs = [t.detach().requires_grad_(t.requires_grad and t.is_floating_point())
                  for t in first + list(rest)]
        if inputs and rec is not None:
            inputs[0].requires_grad_(fctx.first_requires_grad)
        if rec is not None:
            mgr.trace.append(("compute", rec.slot, rec.buf))
        if mgr.profile:
            start = _mark(inputs[0].device if inputs else None)
        rng_devices = fctx.rng_devices if fctx.preserve else []
        with torch.random.fork_rng(devices=rng_devices, enabled=fctx.preserve,
                                   device_type=fctx.device_type if fctx.device_type != "cpu" else "cuda"):
            if fctx.preserve:
                torch.set_rng_state(fctx.cpu_rng)
                if rng_devices:
                    set_device_states(fctx.rng_devices, fctx.rng_states)
            enabled, dtype, cache = fctx.autocast
            # the recomputed outputs only root the backward below: their values are never read
            with torch.enable_grad(), torch.autocast(fctx.device_type, enabled=enabled,
                                                     dtype=dtype, cache_enabled=cache), outputs_unread(module_of(fctx.function)):
                out = fctx.function(*fctx.rebuild(inputs), **fctx.kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if mgr.profile:
            mgr._step._compute_events.append((start, _mark(inputs[0].device if inputs else None)))
        if rec is not None:
            mgr._done(rec)
        grads = tuple(t.grad if need else None for t, need in zip(inputs, fctx.needs_input_grad[6:]))
        return (None, None, None, None, None, None) + grads


def _restricted(anchor: torch.Tensor) -> bool:
    """Whether the running backward leaves out some leaves: the anchor, an input of every offloaded
    call, is a leaf a plain ``backward()`` reaches; ``backward(inputs=...)`` without it does not,
    and under ``torch.autograd.grad`` the engine cannot say (it raises)."""
    try:
        return not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(anchor).node)
    except RuntimeError:
        return True


def _mark(device):
    if device is not None and device.type == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(device))
        return e
    return time.perf_counter()
