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

Only torch is imported here (transformers is used through the model object you pass in).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import get_device_states, set_device_states

from optim.switches import Switch

log = logging.getLogger("optim.offload")

MODES = ("none", "single", "double", "save_on_cpu")
DEFAULT_MIN_BYTES = 1 << 20  # below 1 MiB the copy's fixed cost outweighs the memory it frees

SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        # Off by default: offloading trades step time for VRAM, and whether a run is memory-bound
        # is not something this module can know. When a run needs the memory, "double" is the
        # value to pick (it hides the reloads behind the backward compute).
        Switch(
            "offload",
            MODES,
            "none",
            "checkpointed layer inputs to pinned host memory: none = plain GPU checkpointing; "
            "single = one staging buffer (copy, wait, compute); double = two buffers, reload of "
            "layer i-1 prefetched during layer i's backward; save_on_cpu = PyTorch's "
            "save_on_cpu(pin_memory=True) around checkpointing (peer)",
        ),
        Switch(
            "offload_guard",
            (True, False),
            True,
            "use the second staging buffer only when the memory the process can still allocate "
            "covers the step's peak growth, the buffer and a headroom (else fall back to single)",
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# Per-call record and per-step statistics
# ---------------------------------------------------------------------------------------------


class _Record:
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


# ---------------------------------------------------------------------------------------------
# The offloader: slots, host pool, staging buffers, prefetch order
# ---------------------------------------------------------------------------------------------


class Offloader:
    """A checkpoint function with offloaded inputs; call it like ``torch.utils.checkpoint.checkpoint``.

    One offloader serves one model (it learns the layer order from the forward calls). It is
    itself the ``gradient_checkpointing_func`` that transformers calls as ``func(layer_call, *args)``.
    """

    def __init__(
        self,
        mode: str = "double",
        *,
        guard: bool = True,
        min_bytes: int = DEFAULT_MIN_BYTES,
        headroom_bytes: int | None = None,
        profile: bool = False,
        preserve_rng_state: bool = True,
        mem_get_info: Callable[[], tuple[int, int]] | None = None,
    ):
        self.requested_mode = SWITCHES["offload"].parse(mode)
        self.mode = self.requested_mode  # effective mode after fallbacks
        self.guard = guard
        self.min_bytes = int(min_bytes)
        self.headroom_bytes = headroom_bytes  # None: max(512 MiB, 2 % of the device)
        self.profile = profile
        self.preserve_rng_state = preserve_rng_state
        self._mem_get_info = mem_get_info  # test hook; None: torch.cuda.mem_get_info on CUDA
        self.fallbacks: list[str] = []
        self.guard_decision: dict | None = None  # the memory figures of the last guard check
        # Host pool: slot -> flat uint8 buffer (pinned on CUDA). A slot is a layer position in the
        # forward; the lowest free slot is taken, so steady training maps layer k to slot k.
        self._host: dict[int, torch.Tensor] = {}
        self._slot_owner: dict[int, int] = {}  # slot -> rid of the record holding it
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staging_owner: list[int | None] = [None, None]  # rid whose input is in the buffer
        self._staging_free: list[Any] = [None, None]  # event: last compute reading the buffer
        self._loads = 0  # staging buffers alternate by load order
        self.host_allocs = 0
        self.staging_allocs = 0
        self._stream = None
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._next_rid = 0
        self._order: list[weakref.ref] = []  # this step's records, forward order
        self._pending: weakref.ref | None = None
        self._in_backward = False
        self._warned_kw = False
        self._step = StepStats(self.mode)
        self.trace: list[tuple] = []  # this step's copy/compute order, for tests and debugging

    # -- public ----------------------------------------------------------------------------

    def __call__(self, function, *args, use_reentrant=None, preserve_rng_state=None,
                 **kwargs):
        """``checkpoint(function, *args, **kwargs)``; ``use_reentrant`` is accepted and ignored."""
        preserve = self.preserve_rng_state if preserve_rng_state is None else preserve_rng_state
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)  # nothing to save: no recompute either
        if self.mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return _torch_checkpoint(function, *args, use_reentrant=False,
                                         preserve_rng_state=preserve, **kwargs)
        if self.mode == "none" or self._kw_needs_grad(function, kwargs):
            return _torch_checkpoint(function, *args, use_reentrant=False,
                                     preserve_rng_state=preserve, **kwargs)
        tensors, rebuild = _split_args(args)
        anchor = self._anchor(tensors[0].device if tensors else torch.device("cpu"))
        return _OffloadFunction.apply(self, function, kwargs, rebuild, preserve, anchor, *tensors)

    checkpoint = __call__

    def stats(self) -> dict:
        """The current (or just finished) step, plus pool sizes; reads profile events (syncs)."""
        out = self._step.as_dict()
        out.update(
            requested_mode=self.requested_mode,
            effective_mode=self.mode,
            fallbacks=list(self.fallbacks),
            host_allocs=self.host_allocs,
            staging_allocs=self.staging_allocs,
            host_buffer_bytes=sum(b.numel() for b in self._host.values()),
            host_pinned=all(b.is_pinned() for b in self._host.values()) if self._host else None,
            staging_buffer_bytes=[0 if b is None else b.numel() for b in self._staging],
            guard_decision=self.guard_decision,
        )
        return out

    def close(self) -> None:
        """Release the host pool and the staging buffers (after the last backward)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._host.clear()
        self._slot_owner.clear()
        self._staging = [None, None]
        self._staging_owner = [None, None]
        self._staging_free = [None, None]
        self._order.clear()
        self._pending = None

    # -- forward side ----------------------------------------------------------------------

    def _anchor(self, device: torch.device) -> torch.Tensor:
        # An empty input that requires grad, so the output requires grad (and the backward runs,
        # filling parameter grads) even when no real input does: non-reentrant semantics.
        a = self._anchors.get(device)
        if a is None:
            a = self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return a

    def _kw_needs_grad(self, function, kwargs) -> bool:
        """Keyword tensors ride in a closure, not through autograd: if one needs a grad, use
        torch's checkpoint for that call (correct, not offloaded)."""
        kws = dict(kwargs)
        if isinstance(function, functools.partial):
            kws.update(function.keywords)
        for v in kws.values():
            items = v if isinstance(v, (tuple, list)) else (v,)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in items):
                if not self._warned_kw:
                    self._warned_kw = True
                    log.info("offload: a keyword tensor requires grad; such calls use plain checkpointing")
                return True
        return False

    def _on_forward(self, x: torch.Tensor | None) -> _Record | None:
        if self._in_backward:  # first forward after a backward: a new step
            self._new_step()
        self._step.layers += 1
        # The previous layer now has a successor: its input can leave the device.
        prev = self._pending() if self._pending is not None else None
        self._pending = None
        if prev is not None and prev.state == "pending":
            self._offload(prev)
        if x is None:
            return None
        if len(self._order) > 4096:  # forwards with grad but no backward (their graphs died)
            self._order = [r for r in self._order if r() is not None]
            for i, r in enumerate(self._order):
                r().pos = i
        rec = _Record(self._next_rid, len(self._order), x)
        self._next_rid += 1
        self._order.append(weakref.ref(rec, functools.partial(_release_dead, weakref.ref(self),
                                                              rec.rid)))
        if self.mode not in ("single", "double"):
            rec.state = "kept"
        elif rec.nbytes < max(self.min_bytes, 1):
            rec.state = "kept"
            self._step.kept_small += 1
        elif x.requires_grad and x.grad_fn is None:
            # A leaf that requires grad (the embedding output after peft's/transformers'
            # enable_input_require_grads hook) is held by its AccumulateGrad node until the
            # backward: a host copy would free nothing.
            rec.state = "kept"
            self._step.kept_leaf += 1
        else:
            self._pending = weakref.ref(rec)
        return rec

    def _new_step(self) -> None:
        self._in_backward = False
        self._order = [r for r in self._order if (x := r()) is not None and x.state != "done"]
        for i, r in enumerate(self._order):
            r().pos = i
        self._step = StepStats(self.mode)
        self._loads = 0
        self.trace = []

    def _copy_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _offload(self, rec: _Record) -> None:
        x = rec.x
        if not self._ensure_staging(0, rec):
            rec.state = "kept"
            return
        slot = next(s for s in range(len(self._slot_owner) + 1) if s not in self._slot_owner)
        host = self._host_buffer(slot, rec)
        if host is None:
            rec.state = "kept"
            return
        self._slot_owner[slot] = rec.rid
        rec.slot = slot
        view = host[: rec.nbytes].view(rec.dtype).view(rec.shape)
        if x.is_cuda:
            cs = self._copy_stream()
            cs.wait_stream(torch.cuda.current_stream(x.device))  # x is ready on the compute stream
            with torch.cuda.stream(cs):
                view.copy_(x, non_blocking=True)
            x.record_stream(cs)  # the allocator keeps x's memory until the copy has read it
        else:
            view.copy_(x)
        rec.x = None  # the device copy is released here (once the copy is done, on CUDA)
        rec.state = "offloaded"
        self._step.offloaded += 1
        self._step.bytes_per_layer.append(rec.nbytes)
        self.trace.append(("d2h", slot))

    def _host_buffer(self, slot: int, rec: _Record) -> torch.Tensor | None:
        buf = self._host.get(slot)
        if buf is not None and buf.numel() >= rec.nbytes:
            return buf
        self._host.pop(slot, None)  # a larger batch: regrow this slot
        try:
            # Pinned memory is what makes the copy asynchronous and full-bandwidth; without
            # CUDA there is nothing to pin.
            buf = self._alloc_host(rec.nbytes, pin=rec.device.type == "cuda")
        except (RuntimeError, torch.OutOfMemoryError) as e:
            self._fallback("none", f"pinned host memory unavailable ({str(e).splitlines()[0][:120]})")
            return None
        self.host_allocs += 1
        self._host[slot] = buf
        return buf

    def _alloc_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        # page-locked memory is resident from the start: no first-touch faults in the copies
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    # -- staging buffers and the memory guard ----------------------------------------------

    def _ensure_staging(self, i: int, rec: _Record) -> bool:
        buf = self._staging[i]
        if buf is not None and buf.numel() >= rec.nbytes and buf.device == rec.device:
            return True
        if i == 1 and self.guard and not self._guard_ok(rec):
            return False
        try:
            # A larger batch: the smaller buffer stays until the new one exists, since inputs
            # already offloaded this step may still need it if the allocation fails.
            buf = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)
        except torch.OutOfMemoryError:
            if i == 1:
                self._fallback("single", "no GPU memory for the second staging buffer")
            else:
                self._fallback("none", "no GPU memory for a staging buffer")
            return False
        if buf.is_cuda:
            # The caching allocator hands out a block as soon as the host has freed it, in the
            # order of the stream that allocates: kernels already queued on the compute stream
            # may still read or write the tensor that held it. Compute-stream work is ordered
            # after them; copy-stream work is not, so the reload about to be written here would
            # race them (the first step's gradients came out wrong, with only the second buffer,
            # which is allocated mid-backward). The copy stream waits for everything queued on
            # the compute stream so far, once per allocation.
            cs = self._copy_stream()
            cs.wait_stream(torch.cuda.current_stream(rec.device))
            buf.record_stream(cs)  # written on the copy stream: freed only after its copies
        self._staging[i] = buf
        self._staging_owner[i] = None
        self.staging_allocs += 1
        return True

    def _guard_ok(self, rec: _Record) -> bool:
        """The second buffer stays allocated for the rest of training, so it must fit beside the
        step's peak, not just in the memory free at this moment (mid-backward, when it is
        allocated, the loss and the last layer's recompute have come and gone; they come back
        every step). Allowed when what the process can still allocate (free on the device plus
        blocks the caching allocator holds unused) covers the growth above today's allocation
        that the peak has shown (``max_memory_allocated - memory_allocated``), plus the buffer,
        plus a headroom for fragmentation and layers that need a little more.

        The peak is the process's: one left by a larger computation before training (an eval
        pass with a bigger batch) makes the guard stricter, never looser; reset it with
        ``torch.cuda.reset_peak_memory_stats()`` before the first step to judge by training alone.
        """
        headroom = self.headroom_bytes
        if self._mem_get_info is not None:
            usable, total = self._mem_get_info()
            above = 0
        elif rec.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(rec.device)
            alloc = torch.cuda.memory_allocated(rec.device)
            usable = free + max(0, torch.cuda.memory_reserved(rec.device) - alloc)
            above = max(0, torch.cuda.max_memory_allocated(rec.device) - alloc)
        else:
            return True  # host memory: no device to exhaust
        if headroom is None:
            headroom = max(512 << 20, int(0.02 * total))
        need = above + rec.nbytes + headroom
        ok = usable >= need
        self.guard_decision = {
            "usable_gib": usable / 2**30, "peak_growth_gib": above / 2**30,
            "buffer_gib": rec.nbytes / 2**30, "headroom_gib": headroom / 2**30,
            "second_buffer": ok,
        }
        if not ok:
            self._fallback("single", f"usable GPU memory {usable / 2**30:.2f} GiB < the step's peak growth "
                                     f"{above / 2**30:.2f} GiB + second buffer {rec.nbytes / 2**30:.2f} GiB "
                                     f"+ headroom {headroom / 2**30:.2f} GiB (the growth is the process's peak "
                                     "less what is allocated now; an earlier, larger computation raises it "
                                     "until torch.cuda.reset_peak_memory_stats())")
        return ok

    def _fallback(self, mode: str, why: str) -> None:
        order = {"none": 0, "single": 1, "double": 2}
        if order.get(mode, 0) >= order.get(self.mode, 0):
            return
        log.warning("offload: %s; falling back from %s to %s", why, self.mode, mode)
        self.fallbacks.append(f"{self.mode}->{mode}: {why}")
        self.mode = mode
        self._step.mode = mode

    # -- backward side ---------------------------------------------------------------------

    def _load(self, rec: _Record, *, prefetch: bool) -> bool:
        """Issue the reload of ``rec`` into the next staging buffer (alternating in double)."""
        i = self._loads % (2 if self.mode == "double" else 1)
        if i == 1 and not self._ensure_staging(1, rec):
            if prefetch:
                # Fell back to single: buffer 0 is the one the current layer is about to read,
                # so there is nothing to prefetch into.
                return False
            i = 0
        self._loads += 1
        staging = self._staging[i]
        host = self._host[rec.slot]
        src = host[: rec.nbytes].view(rec.dtype).view(rec.shape)
        dst = staging[: rec.nbytes].view(rec.dtype).view(rec.shape)
        # The buffer's previous owner (if any) loses it: it reloads on demand if still needed.
        self._staging_owner[i] = rec.rid
        rec.buf = i
        if staging.is_cuda:
            cs = self._copy_stream()
            with torch.cuda.stream(cs):
                if self._staging_free[i] is not None:
                    cs.wait_event(self._staging_free[i])  # the last compute reading it is done
                if self.profile:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(cs)
                dst.copy_(src, non_blocking=True)
                rec.loaded_evt = torch.cuda.Event(enable_timing=self.profile)
                rec.loaded_evt.record(cs)
            if self.profile:
                self._step._reload_events.append((start, rec.loaded_evt))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            if self.profile:
                self._step._reload_events.append((t0, time.perf_counter()))
        rec.state = "loaded"
        if prefetch:
            self._step.prefetched += 1
        else:
            self._step.demand_loads += 1
        self.trace.append(("h2d", rec.slot, i, "prefetch" if prefetch else "demand"))
        return True

    def _acquire(self, rec: _Record) -> torch.Tensor:
        """The layer input for ``rec``'s recompute; issues the one-ahead prefetch in double."""
        self._in_backward = True
        self._pending = None  # whatever was waiting for a successor stays on the device
        if rec.state == "pending":
            rec.state = "kept"  # the last layer: its backward comes first, so it never leaves
            self._step.kept_last += 1
        if rec.state == "kept":
            x = rec.x
        elif rec.state in ("offloaded", "loaded"):
            if not (rec.state == "loaded" and self._staging_owner[rec.buf] == rec.rid):
                if rec.state == "loaded":  # its prefetched buffer was taken: not a prefetch hit
                    self._step.prefetched -= 1
                self._load(rec, prefetch=False)
            x = self._staging[rec.buf][: rec.nbytes].view(rec.dtype).view(rec.shape)
            if self.mode == "double":
                nxt = self._previous_offloaded(rec)
                if nxt is not None:
                    self._load(nxt, prefetch=True)  # before this layer's compute is issued
            if rec.loaded_evt is not None:
                torch.cuda.current_stream(x.device).wait_event(rec.loaded_evt)
        else:
            raise RuntimeError(f"optim.offload: backward through a layer twice (state {rec.state}); "
                               "retain_graph is not supported with offloaded checkpointing")
        return x

    def _previous_offloaded(self, rec: _Record) -> _Record | None:
        """The layer whose backward comes next: the nearest earlier live offloaded record."""
        for j in range(rec.pos - 1, -1, -1):
            if j >= len(self._order):
                continue
            r = self._order[j]()
            if r is None or r.state == "done" or r.state == "kept":
                continue
            if r.state == "offloaded":
                return r
            return None  # already loaded (or pending): nothing to prefetch
        return None

    def _done(self, rec: _Record) -> None:
        """After ``rec``'s recompute + backward is issued: free its staging buffer and slot."""
        if rec.buf is not None and self._staging[rec.buf] is not None and \
                self._staging_owner[rec.buf] == rec.rid:
            if self._staging[rec.buf].is_cuda:
                evt = torch.cuda.Event()
                evt.record(torch.cuda.current_stream(self._staging[rec.buf].device))
                self._staging_free[rec.buf] = evt
            self._staging_owner[rec.buf] = None
        if rec.slot is not None and self._slot_owner.get(rec.slot) == rec.rid:
            del self._slot_owner[rec.slot]
        rec.x = None
        rec.state = "done"
        self._step.backward_layers += 1


def _release_dead(mgr_ref, rid: int, _dead) -> None:
    """A record's graph was freed without a backward: give its slot back."""
    mgr = mgr_ref()
    if mgr is None:
        return
    for slot, owner in list(mgr._slot_owner.items()):
        if owner == rid:
            del mgr._slot_owner[slot]
    for i, owner in enumerate(mgr._staging_owner):
        if owner == rid:
            mgr._staging_owner[i] = None


# ---------------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------------


def _split_args(args: tuple) -> tuple[list[torch.Tensor], Callable[[list], list]]:
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


class _OffloadFunction(torch.autograd.Function):
    """Forward without grad, remembering only the inputs (the first one offloaded); backward
    reloads it, recomputes under grad mode and backpropagates through the recomputed graph.

    Reentrant checkpointing's known gaps are closed: the output always requires grad (an anchor
    input), RNG state and autocast state are replayed, and parameter grads accumulate as usual.
    """

    @staticmethod
    def forward(fctx, mgr: Offloader, function, kwargs, rebuild, preserve, anchor, *tensors):
        fctx.mgr, fctx.function, fctx.kwargs, fctx.rebuild = mgr, function, kwargs, rebuild
        fctx.preserve = preserve
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
        rec: _Record | None = fctx.record
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
            with torch.enable_grad(), torch.autocast(fctx.device_type, enabled=enabled,
                                                     dtype=dtype, cache_enabled=cache):
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


def _mark(device):
    if device is not None and device.type == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(device))
        return e
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

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
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    headroom_bytes: int | None = None,
    profile: bool = False,
):
    """Turn gradient checkpointing on in a transformers model (peft-wrapped or not), every
    checkpointed layer going through an ``Offloader``. Returns the model; ``get(model)`` returns
    the offloader (its ``stats()``). Calling it again replaces the previous offloader."""
    mode = SWITCHES["offload"].resolve(offload)
    guard = SWITCHES["offload_guard"].resolve(offload_guard)
    base = _hf_model(model)
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.close()
    off = Offloader(mode, guard=guard, min_bytes=min_bytes, headroom_bytes=headroom_bytes,
                    profile=profile)
    # gradient_checkpointing_enable also makes the embeddings' output require grad (peft needs
    # it); then every GradientCheckpointingLayer gets our function, called as f(layer_call, *args).
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=off)
    object.__setattr__(model, _ATTR, off)
    return model


def get(model) -> Offloader | None:
    return getattr(model, _ATTR, None)


def _hf_model(model):
    # The transformers PreTrainedModel inside (peft's wrappers forward attributes but do not
    # define these methods on their class).
    for m in model.modules():
        if getattr(type(m), "_set_gradient_checkpointing", None) is not None and \
                getattr(type(m), "gradient_checkpointing_enable", None) is not None:
            return m
    raise TypeError(f"{type(model).__name__} holds no transformers model with gradient checkpointing")
