"""The ``Offloader``: slots, the pinned host pool, the staging buffers and the prefetch order
of the checkpointed layer inputs; the memory guard and its fall-backs. Its switches live here."""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from optim._memory import usable_and_total
from optim.offload import hostmem
from optim.offload.function import StepStats, OffloadFunction, Record, split_args
from optim.switches import OFFLOAD_MODES, Switch, switches_of

log = logging.getLogger("optim.offload")

MODES = OFFLOAD_MODES
DEFAULT_MIN_BYTES = 1 << 20  # below 1 MiB the copy's fixed cost outweighs the memory it frees

SWITCHES: dict[str, Switch] = switches_of("optim.offload")


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
        self.peak_reset = False  # CUDA's peak statistics were reset so the guard saw the step's own
        self._peak_checked = False
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
        self._device: torch.device | None = None  # the CUDA device whose inputs it offloads
        self._warned_device = False
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
        if self.mode == "none" or self._closure_needs_grad(function, args, kwargs) or self._other_device(args):
            return _torch_checkpoint(function, *args, use_reentrant=False,
                                     preserve_rng_state=preserve, **kwargs)
        tensors, rebuild = split_args(args)
        anchor = self._anchor(tensors[0].device if tensors else torch.device("cpu"))
        return OffloadFunction.apply(self, function, kwargs, rebuild, preserve, anchor, *tensors)

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
            peak_reset=self.peak_reset,
        )
        return out

    def close(self) -> None:
        """Release the host pool and the staging buffers (after the last backward)."""
        if self._stream is not None:
            self._stream.synchronize()
        for buf in self._host.values():
            hostmem.release(buf)  # unpinned now the copy stream is done with it
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

    def _other_device(self, args: tuple) -> bool:
        """A layer on another GPU than the first one offloaded (a model split over GPUs by
        ``device_map``): the staging buffers and the copy stream are that first GPU's, so such a
        call runs torch's checkpoint (correct, not offloaded)."""
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None or not x.is_cuda:
            return False
        if self._device is None:
            self._device = x.device
            return False
        if x.device == self._device:
            return False
        if not self._warned_device:
            self._warned_device = True
            log.info("offload: layers on %s as well as %s; those on %s use plain checkpointing", x.device,
                     self._device, x.device)
        return True

    def _closure_needs_grad(self, function, args: tuple, kwargs) -> bool:
        """Keyword tensors, and tensors inside a positional tuple or list, ride in a closure, not
        through autograd: if one needs a grad, use torch's checkpoint for that call (correct, not
        offloaded)."""
        kws = dict(kwargs)
        if isinstance(function, functools.partial):
            kws.update(function.keywords)
        for v in [*kws.values(), *(a for a in args if isinstance(a, (tuple, list)))]:
            items = v if isinstance(v, (tuple, list)) else (v,)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in items):
                if not self._warned_kw:
                    self._warned_kw = True
                    log.info("offload: a keyword tensor requires grad; such calls use plain checkpointing")
                return True
        return False

    def _on_forward(self, x: torch.Tensor | None) -> Record | None:
        # a checkpointed call inside a layer's recompute (nested checkpointing) runs while a backward
        # does: it is no new step, and its input stays on the device (it lives only as long as the
        # enclosing layer's backward, whose reloaded input must keep its staging buffer)
        nested = torch._C._current_graph_task_id() != -1
        if self._in_backward and not nested:  # first forward after a backward: a new step
            self._new_step()
        self._step.layers += 1
        # The previous layer now has a successor: its input can leave the device.
        prev = self._pending() if self._pending is not None else None
        self._pending = None
        if prev is not None and prev.state == "pending":
            self._offload(prev)
        if x is None:
            return None
        if not self._order and self._guard_pending(x):
            self._forget_earlier_peak(x)
        if len(self._order) > 4096:  # forwards with grad but no backward (their graphs died)
            self._order = [r for r in self._order if r() is not None]
            for i, r in enumerate(self._order):
                r().pos = i
        rec = Record(self._next_rid, len(self._order), x)
        self._next_rid += 1
        self._order.append(weakref.ref(rec, functools.partial(_release_dead, weakref.ref(self),
                                                              rec.rid)))
        if self.mode not in ("single", "double") or nested:
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
            self._stream = torch.cuda.Stream(device=self._device)  # the offloaded layers' GPU, not the current one
        return self._stream

    def _offload(self, rec: Record) -> None:
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

    def _host_buffer(self, slot: int, rec: Record) -> torch.Tensor | None:
        buf = self._host.get(slot)
        if buf is not None and buf.numel() >= rec.nbytes:
            return buf
        if (old := self._host.pop(slot, None)) is not None:  # a larger batch: regrow this slot
            if self._stream is not None:
                self._stream.synchronize()  # its copies (the stream's only users of it) are done
            hostmem.release(old)
        try:  # pinned memory makes the copy asynchronous and full-bandwidth; a CPU run pins nothing
            buf = self._alloc_host(rec.nbytes, pin=rec.device.type == "cuda")
        except (RuntimeError, OSError, torch.OutOfMemoryError) as e:  # OSError: a mapping refused
            self._fallback("none", f"pinned host memory unavailable ({str(e).splitlines()[0][:120]})")
            return None
        self.host_allocs += 1
        self._host[slot] = buf
        return buf

    def _alloc_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        # page-locked memory is resident from the start (no first-touch faults in the copies), of
        # the exact size (``hostmem``: the caching host allocator rounds up to a power of two)
        return hostmem.pinned_empty(nbytes, self._device) if pin else torch.empty(nbytes, dtype=torch.uint8)

    # -- staging buffers and the memory guard ----------------------------------------------

    def _ensure_staging(self, i: int, rec: Record) -> bool:
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

    def _guard_pending(self, x: torch.Tensor) -> bool:
        """The guard will judge the second staging buffer during this step (checked once)."""
        return (self.mode == "double" and self.guard and self._mem_get_info is None and x.is_cuda
                and self._staging[1] is None and not self._peak_checked)

    def _forget_earlier_peak(self, x: torch.Tensor) -> None:
        """At the start of the first step in which the guard decides: when the process's peak, left
        by an earlier and larger computation (an evaluation, another model), would refuse the
        buffer by itself, reset CUDA's peak statistics, so the guard reads this step's own peak.
        Checked once per offloader; reset only then, with one log line."""
        self._peak_checked = True
        usable, total, earlier = _device_memory(x.device)
        if usable >= earlier + x.numel() * x.element_size() + self._headroom(total):
            return  # the earlier peak does not change the decision: the user's statistics stay
        torch.cuda.reset_peak_memory_stats(x.device)
        self.peak_reset = True
        log.info("offload: an earlier computation peaked %.2f GiB above what is allocated now; CUDA's peak "
                 "memory statistics were reset at this step's start, so the guard judges the step's own "
                 "peak", earlier / 2**30)

    def _headroom(self, total: int) -> int:
        return self.headroom_bytes if self.headroom_bytes is not None else max(512 << 20, int(0.02 * total))

    def _guard_ok(self, rec: Record) -> bool:
        """The second buffer stays allocated for the rest of training, so it must fit beside the
        step's peak, not just in the memory free at this moment (mid-backward, when it is
        allocated, the loss and the last layer's recompute have come and gone; they come back
        every step). Allowed when what the process can still allocate (free on the device plus
        blocks the caching allocator holds unused) covers the growth above today's allocation
        that the peak has shown (``max_memory_allocated - memory_allocated``), plus the buffer,
        plus a headroom for fragmentation and layers that need a little more.

        The peak is this step's: where an earlier, larger computation's peak would decide by
        itself, the step started with the statistics reset (``_forget_earlier_peak``).
        """
        if self._mem_get_info is not None:
            usable, total = self._mem_get_info()
            above = 0
        elif rec.device.type == "cuda":
            usable, total, above = _device_memory(rec.device)
        else:
            return True  # host memory: no device to exhaust
        headroom = self._headroom(total)
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
                                     f"+ headroom {headroom / 2**30:.2f} GiB")
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

    def _load(self, rec: Record, *, prefetch: bool) -> bool:
        """Issue the reload of ``rec`` into the next staging buffer (alternating in double)."""
        i = self._loads % (2 if self.mode == "double" else 1)
        if i == 1 and not self._ensure_staging(1, rec):
            if prefetch:
                # Fell back to single: buffer 0 is the one the current layer is about to read,
                # so there is nothing to prefetch into.
                return False
            i = 0
        host = self._host.get(rec.slot)
        if host is None:
            raise RuntimeError("optim.offload: a layer input offloaded in this forward is gone: the offloader was "
                               "closed (optim.disable, or offload enabled again) before its backward ran. Finish the "
                               "backward, or drop the loss, before changing the model's switches.")
        self._loads += 1
        staging = self._staging[i]
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

    def _acquire(self, rec: Record) -> torch.Tensor:
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

    def _previous_offloaded(self, rec: Record) -> Record | None:
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

    def _done(self, rec: Record) -> None:
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


def _device_memory(device: torch.device) -> tuple[int, int, int]:
    """What the process can still allocate on ``device`` (free plus the caching allocator's unused
    blocks, within its per-process fraction), what it may hold in all, and the peak's growth above
    what is allocated now."""
    usable, total = usable_and_total(device)
    return usable, total, max(0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))


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
