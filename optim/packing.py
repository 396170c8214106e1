"""Packed-sequence attention: boundary metadata built once per batch, reused by every layer.

When short documents are packed into one row, every layer needs the same boundary information
(lengths, ``cu_seqlens``, ``max_seqlen`` and the attention structure derived from them). Stock
transformers rebuilds it per forward (SDPA: a dense T×T mask; flash: ``cu_seqlens`` from
position_ids with a ``.item()`` sync in every layer) and gpt-oss never detects packing at all.
Here it is built once per batch and per device, cached, and reused by every layer call and
every gradient-checkpoint recompute.

Use::

    import optim.packing as packing
    model = packing.enable(model)                  # backend "auto", cache on
    batch = packing.PackingCollator(max_length=8192)(examples)
    out = model(**batch, use_cache=False)          # batch carries packing=PackedMetadata

or, with your own tensors, ``model(input_ids=..., position_ids=..., labels=...,
**packing.packed_kwargs(PackedMetadata.from_lengths(lengths)))``. With only ``position_ids``
(no metadata) the boundaries are read from them with exactly one device-to-host sync per batch.

Backends (switch ``packing_backend``):
  * ``sdpa``: ``scaled_dot_product_attention`` with a cached additive block-diagonal causal mask
    (built vectorized, O(T²) memory — the seeds' path);
  * ``flex``: ``flex_attention`` with a cached document ``BlockMask`` built directly at block
    granularity (never a T×T tensor);
  * ``varlen``: FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``) on
    ``cu_seqlens``/``max_seqlen`` (CUDA, fp16/bf16 only).

Cache policy (switch ``packing_cache``):
  * one entry per device; it belongs to one batch and a new batch replaces it;
  * the batch is identified by the ``PackedMetadata`` object (immutable: lengths are tuples),
    or, without one, by the ``position_ids`` tensor object *and* its ``_version`` counter, so an
    in-place edit of position_ids makes the next layer rebuild instead of reading a stale mask;
  * the entry is dropped when the backward pass leaves the first attention layer of the batch
    (an identity autograd node on its query), so no T×T mask outlives the step; in no-grad use
    it lives until the next batch or :func:`release`.
  With the cache off everything is rebuilt in every layer call and every recompute.

gpt-oss attention sinks are applied exactly on every backend (see each path), and sliding-window
layers (``module.sliding_window``/``config.layer_types``) get their own cached structure.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from optim._fallback import passes_through, recompile_limit
from optim.switches import Switch

log = logging.getLogger("optim.packing")

ATTN_NAME = "optim_packed"
FORWARD_KWARG = "packing"  # the model forward kwarg that carries a PackedMetadata
# Prebuilt flex BlockMasks per sliding window, handed to compiled layers (see prebuild_structures)
STRUCTURES_KWARG = "packing_structures"
FLEX_BLOCK = 128  # flex_attention's default sparse block size
BACKENDS = ("sdpa", "flex", "varlen")

SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "packing_cache",
            (True, False),
            True,
            "build packed-sequence metadata and attention structures once per batch (off: in "
            "every layer call and every recompute, the behaviour the seeds measured against)",
        ),
        # "auto" picks the fastest path that can run: on CUDA with fp16/bf16, FlashAttention-2
        # varlen needs no mask at all (only cu_seqlens), skips all cross-document work and is the
        # fastest kernel; flex is next (Triton kernel, skips masked blocks, needs a small BlockMask);
        # SDPA with an explicit mask loses the flash kernel, so it is only the CPU choice (flex has
        # no CPU backward and varlen no CPU kernel).
        Switch(
            "packing_backend",
            ("auto", *BACKENDS, "off"),
            "auto",
            "packed attention kernel: auto = varlen on CUDA (fp16/bf16) when torch has it, "
            "else flex on CUDA, sdpa on CPU; off = leave the model's attention alone (stock)",
        ),
    )
}

# Build and sync counters: what the bench reports per training step ("count, don't assume").
COUNTERS: collections.Counter = collections.Counter()
# Calls per attention kernel that actually ran on the eager path: "flex-fused", "flex-unfused"
# (CPU only), "varlen", "sdpa-mask". Flex traced into compiled layers (optim.regional) runs
# inside the layer's graph and is not counted here; it is always the fused kernel.
KERNEL_CALLS: collections.Counter = collections.Counter()


def reset_counters() -> None:
    COUNTERS.clear()
    KERNEL_CALLS.clear()


def counters() -> dict[str, int]:
    return dict(COUNTERS)


def kernels() -> dict[str, int]:
    """Calls per attention kernel since the last ``reset_counters()`` (see ``KERNEL_CALLS``)."""
    return dict(KERNEL_CALLS)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

_serials = itertools.count(1)


@dataclass(frozen=True, eq=False)
class PackedMetadata:
    """Host-side description of one packed batch: per-row document lengths.

    Everything the kernels need follows from it without reading the device: ``cu_seqlens``
    (over the flattened batch, int32) and ``max_seqlen`` are computed on the host. Device copies
    and attention structures are built lazily, once per device, by the attention function.
    Immutable by design (lengths are tuples), so it can key the cache.
    """

    lengths: tuple[tuple[int, ...], ...]
    seq_len: int
    serial: int = field(default_factory=lambda: next(_serials), compare=False)

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[Sequence[int]] | Sequence[int],
        seq_len: int | None = None,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> "PackedMetadata":
        """``lengths``: per row, the document lengths (a flat list means one row). Each row must
        sum to ``seq_len`` (default: the first row's sum). ``position_ids``, if given, are checked
        against the lengths (free on CPU; one sync if they are on a GPU)."""
        if len(lengths) and not isinstance(lengths[0], (list, tuple)):
            lengths = [lengths]  # type: ignore[list-item]
        rows = tuple(tuple(int(l) for l in row) for row in lengths)  # type: ignore[union-attr]
        if not rows:
            raise ValueError("packing: no rows")
        T = sum(rows[0]) if seq_len is None else int(seq_len)
        for r, row in enumerate(rows):
            if not row:
                raise ValueError(f"packing: row {r} has no documents")
            if min(row) <= 0:
                raise ValueError(f"packing: row {r} has a zero-length or negative document: {list(row)}")
            if sum(row) != T:
                raise ValueError(f"packing: row {r} lengths sum to {sum(row)}, not the row length {T}")
        meta = cls(rows, T)
        if position_ids is not None:
            meta.check_position_ids(position_ids)
        return meta

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackedMetadata":
        """Boundaries from position ids restarting at 0 per document: one device-to-host sync."""
        return cls.from_lengths(_lengths_from_position_ids(position_ids), position_ids.shape[-1])

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(max(r) for r in self.lengths)

    @property
    def num_docs(self) -> int:
        return sum(len(r) for r in self.lengths)

    def cu_seqlens(self) -> torch.Tensor:
        """int32 (num_docs + 1,) CPU offsets over the flattened (B*T) batch."""
        flat = torch.tensor([l for row in self.lengths for l in row], dtype=torch.int32)
        return F.pad(torch.cumsum(flat, 0, dtype=torch.int32), (1, 0))

    def position_ids(self) -> torch.Tensor:
        """(B, T) int64 positions restarting at 0 per document (host, vectorized)."""
        cu = self.cu_seqlens().long()
        lens = cu[1:] - cu[:-1]
        flat = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lens)
        return flat.view(self.batch_size, self.seq_len)

    def check_position_ids(self, position_ids: torch.Tensor) -> None:
        pos = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
        if pos.shape[-1] != self.seq_len or pos.shape[0] not in (1, self.batch_size):
            raise ValueError(
                f"packing: position_ids shape {tuple(position_ids.shape)} does not match "
                f"{self.batch_size} rows of {self.seq_len} tokens"
            )
        expected = self.position_ids().to(pos.device)
        if not torch.equal(pos.expand_as(expected).to(expected.dtype), expected):
            raise ValueError("packing: position_ids disagree with the document lengths "
                             "(they must restart at 0 at each document start and count up by 1)")

    def __repr__(self) -> str:
        return (f"PackedMetadata(rows={self.batch_size}, seq_len={self.seq_len}, "
                f"docs={self.num_docs}, max_seqlen={self.max_seqlen})")


def packed_kwargs(meta: PackedMetadata) -> dict[str, PackedMetadata]:
    """The extra forward kwarg that hands a batch's packing to an enabled model."""
    return {FORWARD_KWARG: meta}


def _lengths_from_position_ids(position_ids: torch.Tensor) -> list[list[int]]:
    """Per-row document lengths from positions restarting at 0: exactly one device-to-host
    transfer (the start flags and the validity bit travel together)."""
    pos = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
    starts = pos == 0
    steps = pos[:, 1:] == pos[:, :-1] + 1
    ok = starts[:, 0].all() & (starts[:, 1:] | steps).all()
    host = torch.cat([starts.flatten(), ok.view(1)]).cpu()
    COUNTERS["position_id_reads"] += 1
    if pos.device.type != "cpu":
        COUNTERS["host_syncs"] += 1
    if not bool(host[-1]):
        raise ValueError("packing: position_ids must restart at 0 at each document start and count "
                         "up by 1 inside a document (got a row that does not)")
    B, T = pos.shape
    out = []
    for row in host[:-1].view(B, T):
        idx = torch.nonzero(row).flatten()
        out.append(torch.diff(idx, append=torch.tensor([T])).tolist())
    return out


# ---------------------------------------------------------------------------------------------
# Per-device cache
# ---------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """Device metadata of one batch plus the attention structures built from it."""

    key: tuple
    B: int
    T: int
    cu_seqlens: torch.Tensor  # int32 (num_docs+1,) on device, offsets over the flattened batch
    max_seqlen: int  # host int
    doc: torch.Tensor  # int32 (B, T): global document index of each token
    start: torch.Tensor  # int64 (B, T): row-local index of the token's document start
    structures: dict = field(default_factory=dict)
    pos_ref: Any = None  # weakref to the position_ids the entry was keyed on
    first_module: int | None = None  # id() of the first attention module that used the entry


_CACHE: dict[torch.device, _Entry] = {}


def release(device: torch.device | str | None = None) -> None:
    """Drop the cached entry for ``device`` (all devices if None)."""
    if device is None:
        _CACHE.clear()
    else:
        _CACHE.pop(torch.device(device), None)


def cached_entry(device: torch.device | str) -> _Entry | None:
    """The entry cached for ``device`` (for tests and benchmarks)."""
    return _CACHE.get(_canonical(torch.device(device)))


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` are one cache slot: key on the indexed form."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _build_entry(key: tuple, meta: PackedMetadata, device: torch.device) -> _Entry:
    """Device metadata from the host lengths: one small host-to-device copy, no sync."""
    COUNTERS["metadata"] += 1
    B, T = meta.batch_size, meta.seq_len
    cu_host = meta.cu_seqlens()
    if device.type == "cuda":
        cu_host = cu_host.pin_memory()
    cu = cu_host.to(device, non_blocking=True)
    # Document index per token: mark the starts, cumsum. Vectorized, no loop per document.
    seg = torch.zeros(B * T, dtype=torch.int32, device=device)
    # scatter_, not seg[idx] = 1: advanced-index assignment checks its indices with a sync
    starts = cu[1:-1].long()
    seg.scatter_(0, starts, torch.ones_like(starts, dtype=seg.dtype))
    doc = torch.cumsum(seg, 0, dtype=torch.int32)
    row0 = (torch.arange(B * T, device=device) // T) * T
    start = cu[doc.long()].long() - row0
    return _Entry(key, B, T, cu, meta.max_seqlen, doc.view(B, T), start.view(B, T))


def _entry_for(packing, position_ids, B: int, T: int, device: torch.device, cache: bool,
               validate: bool) -> _Entry:
    """The batch's entry: from the cache when the batch is the cached one, else built."""
    if packing is not None:
        if not isinstance(packing, PackedMetadata):
            raise TypeError(f"packing= must be a PackedMetadata, got {type(packing).__name__}")
        key = ("meta", packing.serial)
        pos_ref = None
    elif position_ids is not None:
        key = ("pos", id(position_ids), position_ids._version)
        pos_ref = weakref.ref(position_ids)
    else:
        raise ValueError("packed attention needs packing=PackedMetadata or position_ids")

    if cache:
        hit = _CACHE.get(device)
        if hit is not None and hit.key == key and (pos_ref is None or hit.pos_ref() is position_ids):
            COUNTERS["cache_hits"] += 1
            return hit

    if packing is None:
        pos = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
        meta = PackedMetadata.from_lengths(_lengths_from_position_ids(pos), T)
        if meta.batch_size == 1 and B > 1:  # (1, T) positions shared by every row
            meta = PackedMetadata.from_lengths([meta.lengths[0]] * B, T)
    else:
        meta = packing
        if validate and position_ids is not None:
            meta.check_position_ids(position_ids)
    if meta.batch_size != B or meta.seq_len != T:
        raise ValueError(f"packing: metadata describes {meta.batch_size}x{meta.seq_len} tokens but "
                         f"the batch is {B}x{T}")
    entry = _build_entry(key, meta, device)
    entry.pos_ref = pos_ref
    if cache:
        _CACHE[_canonical(device)] = entry  # a new batch replaces the old one on this device
    return entry


class _ReleaseOnBackward(torch.autograd.Function):
    """Identity on the query of the batch's first attention call. Its backward runs after that
    layer's attention backward, i.e. after the last use of the cached structures in the step,
    and drops the entry so that no T×T mask stays resident."""

    @staticmethod
    def forward(ctx, x, entry_key, device):
        ctx.entry_key, ctx.device = entry_key, device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        hit = _CACHE.get(ctx.device)
        if hit is not None and hit.key == ctx.entry_key:
            del _CACHE[ctx.device]
            COUNTERS["releases"] += 1
        return grad, None, None


# ---------------------------------------------------------------------------------------------
# Structures (one build per batch, per backend and window, when cached)
# ---------------------------------------------------------------------------------------------


def _structure(entry: _Entry, key: tuple, build, cache: bool):
    if cache and key in entry.structures:
        return entry.structures[key]
    value = build()
    if cache:
        entry.structures[key] = value
    return value


def _allowed(entry: _Entry, window: int | None) -> torch.Tensor:
    """(B, T, T) bool: same document, causal, and inside the sliding window. Broadcast, no loop."""
    idx = torch.arange(entry.T, device=entry.doc.device)
    ok = (entry.doc[:, :, None] == entry.doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        ok &= (idx[:, None] - idx[None, :]) < window
    return ok


def build_sdpa_mask(entry: _Entry, window: int | None, dtype: torch.dtype, sink_cols: int) -> torch.Tensor:
    """Additive (B, 1, T, T + sink_cols) mask in the attention dtype. Additive rather than bool
    because SDPA converts a bool mask to a float one on every call; the last dim is allocated
    padded to a multiple of 8 so the memory-efficient kernel gets an aligned stride (it would
    otherwise copy the mask per call)."""
    COUNTERS["sdpa_mask"] += 1
    B, T = entry.B, entry.T
    width = T + sink_cols
    mask = torch.full((B, 1, T, -(-width // 8) * 8), float("-inf"), dtype=dtype, device=entry.doc.device)
    mask[:, 0, :, :T].masked_fill_(_allowed(entry, window), 0.0)
    if sink_cols:
        mask[..., T:width] = 0.0
    return mask[..., :width]


def build_flex_block_mask(entry: _Entry, window: int | None):
    """Document (+window) causal BlockMask built at block granularity: O((T/128)²), no T×T.

    For query t the visible keys are one interval [lo(t), t], lo(t) = max(doc start, t-w+1),
    and lo is non-decreasing, so a query block [qa, qb] sees the key interval [lo(qa), qb]; a key
    block [ka, kb] is fully visible iff kb <= qa and ka >= lo(qb). Visible-but-not-full blocks are
    partial and get the mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    COUNTERS["flex_block_mask"] += 1
    B, T, dev = entry.B, entry.T, entry.doc.device
    bs = FLEX_BLOCK
    nb = -(-T // bs)
    idx = torch.arange(T, device=dev)
    lo = entry.start if window is None else torch.maximum(entry.start, idx - window + 1)
    qa = torch.arange(nb, device=dev) * bs
    qb = torch.clamp(qa + bs, max=T) - 1
    lo_a, lo_b = lo[:, qa], lo[:, qb]  # (B, nb)
    j = torch.arange(nb, device=dev)
    i = j.view(nb, 1)
    visible = (j >= (lo_a // bs)[:, :, None]) & (j <= (qb // bs)[:, None])
    full = (j >= ((lo_b + bs - 1) // bs)[:, :, None]) & (j <= i - 1)
    partial = visible & ~full

    def ordered(m):  # dense (B, nb, nb) bool -> (counts, indices) with the chosen blocks first
        counts = m.sum(-1, dtype=torch.int32)[:, None]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return counts, order

    doc = F.pad(entry.doc, (0, nb * bs - T), value=-1)
    # a partial of a module-level function rather than a closure: a compiled layer that takes the
    # mask as input guards on the function, and a new closure per batch would recompile it
    mask_mod = functools.partial(_doc_mask_mod, doc, window)
    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs,
                                    mask_mod=mask_mod, seq_lengths=(T, T))


def _doc_mask_mod(doc, window, b, h, q_idx, kv_idx):
    keep = (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
    if window is not None:
        keep = keep & (q_idx - kv_idx < window)
    return keep


def build_varlen_args(entry: _Entry) -> tuple[torch.Tensor, int]:
    """varlen takes the metadata as is: int32 cu_seqlens on device and a host max_seqlen."""
    COUNTERS["varlen_args"] += 1
    return entry.cu_seqlens, entry.max_seqlen


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)


def _sdpa(entry, q, k, v, scale, window, sinks, cache):
    B, H, T, D = q.shape
    k, v = _repeat_kv(k, H // k.shape[1]), _repeat_kv(v, H // v.shape[1])
    sink_cols = 0 if sinks is None else 1
    mask = _structure(entry, ("sdpa", window, q.dtype, sink_cols),
                      lambda: build_sdpa_mask(entry, window, q.dtype, sink_cols), cache)
    if sinks is not None:
        # Exact sinks with SDPA, which returns no log-sum-exp: append one "sink" key per head whose
        # score is exactly sink_h and whose value is 0. It adds exp(sink) to the softmax
        # denominator only, which is the definition of a sink, and autograd gives exact gradients
        # for q, k, v and the sinks. Head dim is padded by 8 zero columns (alignment); only the
        # first extra column is used: q gets 1 there, the sink key gets sink_h / scale.
        pad = 8
        extra_q = torch.zeros(B, H, T, pad, dtype=q.dtype, device=q.device)
        extra_q[..., 0] = 1
        q = torch.cat([q, extra_q], -1)
        k = torch.cat([k, torch.zeros(B, H, T, pad, dtype=k.dtype, device=k.device)], -1)
        sink_key = torch.zeros(B, H, 1, D + pad, dtype=k.dtype, device=k.device)
        sink_key = sink_key + F.pad((sinks.to(k.dtype) / scale).view(1, H, 1, 1), (D, pad - 1))
        k = torch.cat([k, sink_key], 2)
        v = F.pad(v, (0, pad, 0, 1))  # sink value 0; pad head dim to match q/k
    KERNEL_CALLS["sdpa-mask"] += 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if sinks is not None:
        out = out[..., :D]
    return out.transpose(1, 2).contiguous()


# flex_attention has two implementations. Compiled, it is one fused Triton kernel that skips
# masked blocks and never holds the scores. Called eagerly, it materializes the B×H×T×T scores:
# O(T²) memory (27.9 GB for a 16K-token forward of a tiny Llama) and a far slower step. So on
# CUDA the fused kernel runs or another packed kernel does, never the eager one:
#
# - It is compiled as a function of this module's own (``_fused_flex_body``), not as
#   ``torch.compile(flex_attention)``. dynamo keeps one cache per code object, with a limit of 8
#   entries by default, and every ``torch.compile(flex_attention)`` in the process shares
#   flex_attention's: transformers' own flex path compiles it with ``dynamic=False``, one entry per
#   shape. Once that cache was full, dynamo ran our call eagerly, with only a warning from torch
#   (the GPU suite, after the stock-flex tests). Our cache holds our entries alone, with the limit
#   of optim's compiled paths (``optim._fallback.RECOMPILE_LIMIT``).
# - If dynamo still runs it eagerly (the limit reached, dynamo disabled, an eager stance), the body
#   notices before flex_attention runs (``torch.compiler.is_compiling()`` is False) and says so; a
#   compiler error is caught the same way. Either way optim.packing logs one line and runs varlen
#   for the rest of the process, or raises ``FusedFlexUnavailable`` where varlen cannot run.
# - ``kernels()`` counts the calls of each kernel that ran; result rows record it.
#
# On CPU the eager flex is the only one with a backward; it runs there, counted as unfused.

_FLEX_COMPILE_BACKEND = "inductor"  # the fused kernel is inductor's; CPU tests of the fallback swap it
_fused_flex_compiled = None
_fused_flex_failed: str | None = None  # why the fused kernel cannot run in this process


class FusedFlexUnavailable(RuntimeError):
    """flex_attention's fused kernel cannot run here, and no other packed kernel can stand in."""


class _RanEager(Exception):
    """dynamo ran the fused-flex body as plain Python: flex_attention would take its unfused path."""


def _flex_core(flex, q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    """One flex_attention call, (out, lse or None); ``flex`` is traced or compiled by the caller."""
    if not want_lse:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa), None
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                    return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _fused_flex_body(q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    if not torch.compiler.is_compiling():  # a constant True wherever dynamo traces this
        raise _RanEager
    from torch.nn.attention.flex_attention import flex_attention

    return _flex_core(flex_attention, q, k, v, block_mask, scale, gqa, want_lse)


def fused_flex_failure() -> str | None:
    """Why flex_attention's fused kernel cannot run in this process (None while it can)."""
    return _fused_flex_failed


def _fused_flex(q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    """(out, lse) from the fused kernel, or None once it cannot be had (the reason is kept)."""
    global _fused_flex_compiled, _fused_flex_failed
    if _fused_flex_failed is not None:
        return None
    if _fused_flex_compiled is None:
        _fused_flex_compiled = torch.compile(_fused_flex_body, fullgraph=True, backend=_FLEX_COMPILE_BACKEND)
    try:
        with recompile_limit():
            return _fused_flex_compiled(q, k, v, block_mask, scale, gqa, want_lse)
    except _RanEager:
        why = "torch.compile ran it eagerly (dynamo disabled, or an eager stance)"
    except Exception as e:  # a compiler failure (or the recompile limit) must not stop training
        if passes_through(e):
            raise
        msg = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    _fused_flex_failed = why
    return None


def _flex(entry, q, k, v, scale, window, sinks, cache):
    block_mask = _structure(entry, ("flex", window), lambda: build_flex_block_mask(entry, window), cache)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        from torch.nn.attention.flex_attention import flex_attention

        KERNEL_CALLS["flex-unfused"] += 1
        out, lse = _flex_core(flex_attention, q, k, v, block_mask, scale, gqa, sinks is not None)
        return _flex_output(out, lse, sinks, q.dtype)
    res = _fused_flex(q, k, v, block_mask, scale, gqa, sinks is not None)
    if res is None:
        return _flex_stand_in(entry, q, k, v, scale, window, sinks, cache)
    KERNEL_CALLS["flex-fused"] += 1
    return _flex_output(*res, sinks, q.dtype)


_stand_in_logged = False


def _flex_stand_in(entry, q, k, v, scale, window, sinks, cache):
    """varlen in place of a fused flex that cannot run; never the unfused flex."""
    global _stand_in_logged
    why = _fused_flex_failed
    if q.dtype not in (torch.float16, torch.bfloat16) or not varlen_available():
        raise FusedFlexUnavailable(
            f"optim.packing: flex_attention's fused kernel cannot run ({why}), and the varlen kernel "
            f"cannot stand in ({q.dtype}, varlen needs fp16/bf16 and a CUDA flash kernel). The unfused "
            "flex_attention would hold B x H x T x T scores, so it is not used; pick "
            "packing_backend='sdpa' (a T x T mask) or fix the cause above")
    if not _stand_in_logged:
        _stand_in_logged = True
        log.warning("optim.packing: flex_attention's fused kernel cannot run (%s); running the varlen "
                    "kernel instead for the rest of this process (the unfused flex would hold T x T "
                    "scores)", why)
    return _varlen(entry, q, k, v, scale, window, sinks, cache)


def _flex_output(out, lse, sinks, dtype):
    """(B, H, T, D) -> (B, T, H, D), with exact sinks: renormalize with the kernel's log-sum-exp,
    out * Z / (Z + e^s) = out * sigmoid(lse - s). flex propagates gradients through lse."""
    if sinks is not None:
        factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
        out = (out.float() * factor[..., None]).to(dtype)
    return out.transpose(1, 2).contiguous()


# Indirection so tests can check the sink algebra on CPU with a reference flash implementation.
_flash_ops = {
    "forward": lambda *a, **k: torch.ops.aten._flash_attention_forward(*a, **k),
    "backward": lambda *a, **k: torch.ops.aten._flash_attention_backward(*a, **k),
}


def _window_kw(window_left: int) -> dict:
    """Sliding-window kwargs of the aten flash ops, only when a window is used (older torch
    builds may lack them; full causal attention needs none: is_causal=True)."""
    if window_left < 0:
        return {}
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    if "window_size_left" not in schema:
        raise NotImplementedError("this torch's flash varlen op has no sliding window; use "
                                  "packing_backend='flex' for sliding-window models")
    return {"window_size_left": window_left, "window_size_right": 0}


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 varlen with optional exact attention sinks.

    Sinks: y = o * s where s = sigmoid(lse - sink) per (token, head). That is attention over the
    document plus one zero-valued key of score ``sink``. Its exact backward is the flash backward
    called with grad_out = s * dy and out = y (the kernel then subtracts rowsum(grad_out * out) =
    s * (dy . y), the right softmax-Jacobian term), plus d sink = -sum (1 - s) (dy . y).
    torch's varlen_attn ignores the lse gradient, so it cannot do this; we call the aten ops.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len, scale, window_left):
        res = _flash_ops["forward"](
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **_window_kw(window_left))
        out, lse, rng_a, rng_b = res[0], res[1], res[2], res[3]
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for bf16 inputs
        if sinks is not None:
            s = torch.sigmoid(lse.to(acc) - sinks.to(acc).view(-1, 1)).t().unsqueeze(-1)  # (T, H, 1)
            out = (out.to(acc) * s).to(q.dtype)
        else:
            s = None
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_a, rng_b, s)
        ctx.max_len, ctx.scale, ctx.window_left = max_len, scale, window_left
        ctx.has_sinks = sinks is not None
        ctx.sink_dtype = None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, cu, rng_a, rng_b, s = ctx.saved_tensors
        acc = torch.promote_types(q.dtype, torch.float32)
        dy = dy.contiguous()
        g = dy if s is None else (dy.to(acc) * s).to(dy.dtype)
        dq, dk, dv = _flash_ops["backward"](
            g, q, k, v, y, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_a, rng_b,
            scale=ctx.scale, **_window_kw(ctx.window_left))
        dsink = None
        if ctx.has_sinks:
            dsink = -((1 - s.squeeze(-1)) * (dy.to(acc) * y.to(acc)).sum(-1)).sum(0).to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None, None, None, None


def _public_varlen():
    """torch.nn.attention.varlen.varlen_attn when its signature has what we need (torch >= 2.12:
    window_size and enable_gqa); torch 2.10/2.11 expose fewer arguments, so we use the aten op."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"window_size", "enable_gqa", "scale"} <= set(params) else None


def varlen_available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def _varlen(entry, q, k, v, scale, window, sinks, cache):
    B, H, T, D = q.shape
    cu, max_len = _structure(entry, ("varlen",), lambda: build_varlen_args(entry), cache)
    qf = q.transpose(1, 2).reshape(B * T, H, D)
    kf = k.transpose(1, 2).reshape(B * T, k.shape[1], D)
    vf = v.transpose(1, 2).reshape(B * T, v.shape[1], D)
    left = -1 if window is None else window - 1  # flash keeps keys with q - k <= left
    KERNEL_CALLS["varlen"] += 1
    public = _public_varlen()
    if sinks is None and public is not None:
        out = public(qf, kf, vf, cu, cu, max_len, max_len, scale=scale, window_size=(left, 0),
                     enable_gqa=H != k.shape[1])
    else:
        out = _FlashVarlen.apply(qf, kf, vf, sinks, cu, max_len, scale, left)
    return out.view(B, T, H, D)


_KERNELS = {"sdpa": _sdpa, "flex": _flex, "varlen": _varlen}


def resolve_backend(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    if choice != "auto":
        return choice
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and varlen_available():
            return "varlen"
        return "flex"
    return "sdpa"


# ---------------------------------------------------------------------------------------------
# The attention function and enable()
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackingSettings:
    cache: bool = True
    backend: str = "auto"
    validate: bool | None = None  # None: check position_ids vs metadata where free (CPU tensors)


_DEFAULT = PackingSettings()


def _should_validate(settings: PackingSettings, position_ids) -> bool:
    """Check position_ids against the metadata where it costs no sync (CPU tensors), unless told."""
    if settings.validate is not None:
        return settings.validate
    return position_ids is not None and position_ids.device.type == "cpu"


def _layer_window(module, sliding_window) -> int | None:
    if sliding_window:
        return int(sliding_window)
    w = getattr(module, "sliding_window", None)
    if w:
        return int(w)
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is not None and idx is not None and types[idx] == "sliding_attention":
        return int(config.sliding_window)
    return None


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    packing: PackedMetadata | None = None,
    packing_structures: dict | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, H, T, D) q/k/v in, (B, T, H, D) out.

    Inside a compiled layer (``optim.regional``) with the batch's flex BlockMasks prebuilt
    outside the graph (``prebuild_structures``), flex attention is traced into the layer's
    graph. Everything else runs eager, behind a graph break: the metadata cache is host state.
    """
    if packing_structures is not None and torch.compiler.is_compiling() and not dropout \
            and key.shape[2] == query.shape[2]:
        # the window recorded by enable(), not _layer_window: that reads layer_idx, and a graph
        # guarded on layer_idx would be compiled once per layer
        window = int(sliding_window) if sliding_window else getattr(module, "_optim_packing_window", None)
        block_mask = packing_structures.get(window)
        if block_mask is not None:
            from torch.nn.attention.flex_attention import flex_attention

            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
            gqa = query.shape[1] != key.shape[1]
            out, lse = _flex_core(flex_attention, query, key, value, block_mask, scale, gqa, sinks is not None)
            return _flex_output(out, lse, sinks, query.dtype), None
    return _packed_attention_eager(module, query, key, value, attention_mask, scaling, dropout,
                                   sliding_window, s_aux, position_ids, packing, **kwargs)


@torch.compiler.disable
def _packed_attention_eager(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                            s_aux, position_ids, packing, **kwargs):
    settings: PackingSettings = getattr(module, "_optim_packing", _DEFAULT)
    B, H, T, D = query.shape
    if key.shape[2] != T:
        raise NotImplementedError("packed attention is for training/prefill without a KV cache "
                                  "(pass use_cache=False)")
    if dropout:
        raise NotImplementedError("packed attention does not implement attention dropout")
    scale = scaling if scaling is not None else D ** -0.5
    window = _layer_window(module, sliding_window)
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    device = query.device
    validate = _should_validate(settings, position_ids)
    entry = _entry_for(packing, position_ids, B, T, device, settings.cache, validate)
    if settings.cache and torch.is_grad_enabled() and query.requires_grad:
        if entry.first_module is None:
            entry.first_module = id(module)
        if entry.first_module == id(module):
            query = _ReleaseOnBackward.apply(query, entry.key, device)
    backend = resolve_backend(settings.backend, device, query.dtype)
    out = _KERNELS[backend](entry, query, key, value, scale, window, sinks, settings.cache)
    return out, None


_registered = False


def register() -> None:
    """Register ``packed_attention_forward`` under ``ATTN_NAME`` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, packed_attention_forward)
        _registered = True


def _structures_hook(settings: PackingSettings, windows: tuple):
    def hook(module, args, kwargs):
        meta = kwargs.get(FORWARD_KWARG)
        if meta is None or kwargs.get(STRUCTURES_KWARG) is not None:
            return None
        ref = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None),
                   args[0] if args else None)
        param = next(module.parameters(), None)
        if ref is None or param is None:
            return None
        device, pos = ref.device, kwargs.get("position_ids")
        if resolve_backend(settings.backend, device, param.dtype) != "flex":
            return None
        entry = _entry_for(meta, pos, meta.batch_size, meta.seq_len, device, True,
                           _should_validate(settings, pos))
        masks = {w: _structure(entry, ("flex", w), functools.partial(build_flex_block_mask, entry, w), True)
                 for w in windows}
        return args, {**kwargs, STRUCTURES_KWARG: masks}

    return hook


def prebuild_structures(model) -> int:
    """Build each packed batch's flex BlockMasks once, before the decoder layers run, and hand
    them to every layer as the ``packing_structures`` kwarg; returns the stacks hooked.

    For compiled layers (``optim.regional`` calls this): the masks enter the graph as inputs, so
    flex attention is traced into the layer and one graph serves every batch. Only with the
    cache on and the flex backend; other backends keep their graph break. Idempotent.
    """
    settings = getattr(model, "_optim_packing", None)
    if settings is None or not settings.cache or settings.backend in ("off", "sdpa", "varlen"):
        return 0
    windows = tuple(sorted({_layer_window(m, None) for m in _attention_modules(model)},
                           key=lambda w: -1 if w is None else w))
    n = 0
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and not getattr(m, "_optim_packing_prebuild", False):
            m.register_forward_pre_hook(_structures_hook(settings, windows), with_kwargs=True)
            m._optim_packing_prebuild = True
            n += 1
    return n


def _attention_modules(model) -> Iterable[torch.nn.Module]:
    for m in model.modules():
        if hasattr(m, "q_proj") and hasattr(m, "layer_idx"):
            yield m


def enable(model, *, packing_cache=None, packing_backend=None, validate: bool | None = None,
           **_ignored):
    """Enable packed attention on a transformers causal LM (peft-wrapped or not).

    Registers the attention function, switches the model's attention implementation to it (so
    transformers also stops building its own masks) and records the settings on every attention
    module. Settings: ``packing_cache`` (True/False), ``packing_backend`` (auto/sdpa/flex/varlen,
    or off to leave the model untouched),
    each also from OPTIM_PACKING_CACHE / OPTIM_PACKING_BACKEND. Other optim switches are ignored.
    Returns the model.
    """
    settings = PackingSettings(
        cache=SWITCHES["packing_cache"].resolve(packing_cache),
        backend=SWITCHES["packing_backend"].resolve(packing_backend),
        validate=validate,
    )
    if settings.backend == "off":
        return model
    register()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(ATTN_NAME)
    else:
        model.config._attn_implementation = ATTN_NAME
    n = 0
    for m in _attention_modules(model):
        m._optim_packing = settings
        m._optim_packing_window = _layer_window(m, None)
        n += 1
    if n == 0:
        raise ValueError("packing.enable: found no attention modules (q_proj + layer_idx) in the model")
    model._optim_packing = settings
    return model


# ---------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------


class PackingCollator:
    """Pack a list of tokenized examples into rows of ``max_length`` tokens.

    Greedy first-fit in order; an example longer than ``max_length`` is truncated. Each row's
    free tail becomes one padding document (``pad_token_id``, labels -100) so every row has the
    same length. Labels are the input ids (or the example's ``labels``) with each document's
    first token set to -100, so no token learns to predict across a boundary. Returns
    ``input_ids``, ``labels``, ``position_ids`` (restarting at 0 per document) and
    ``packing`` (a :class:`PackedMetadata`), ready for ``model(**batch)`` and
    ``transformers.Trainer`` (set ``remove_unused_columns=False``).
    """

    def __init__(self, max_length: int | None = None, pad_token_id: int = 0,
                 pad_to_multiple_of: int | None = None, label_pad_id: int = -100):
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.label_pad_id = label_pad_id

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        docs = []
        for ex in examples:
            ids = list(ex["input_ids"])
            labels = list(ex.get("labels", ids))
            if len(labels) != len(ids):
                raise ValueError("packing: an example's labels and input_ids differ in length")
            if not ids:
                continue
            if self.max_length is not None:
                ids, labels = ids[: self.max_length], labels[: self.max_length]
            labels[0] = self.label_pad_id
            docs.append((ids, labels))
        if not docs:
            raise ValueError("packing: no non-empty examples to pack")
        rows: list[list[tuple]] = []
        fill: list[int] = []
        for d in docs:
            for r, used in enumerate(fill):
                if self.max_length is None or used + len(d[0]) <= self.max_length:
                    rows[r].append(d)
                    fill[r] += len(d[0])
                    break
            else:
                rows.append([d])
                fill.append(len(d[0]))
        T = self.max_length if self.max_length is not None else max(fill)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids, labels, lengths = [], [], []
        for row, used in zip(rows, fill):
            ids = [t for d in row for t in d[0]]
            lab = [t for d in row for t in d[1]]
            lens = [len(d[0]) for d in row]
            if used < T:
                ids += [self.pad_token_id] * (T - used)
                lab += [self.label_pad_id] * (T - used)
                lens.append(T - used)
            input_ids.append(ids)
            labels.append(lab)
            lengths.append(lens)
        meta = PackedMetadata.from_lengths(lengths, T)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "position_ids": meta.position_ids(),
            FORWARD_KWARG: meta,
        }


__all__ = [
    "ATTN_NAME", "FORWARD_KWARG", "STRUCTURES_KWARG", "SWITCHES", "COUNTERS", "PackedMetadata", "PackingCollator",
    "PackingSettings", "build_flex_block_mask", "build_sdpa_mask", "build_varlen_args",
    "cached_entry", "counters", "enable", "packed_attention_forward", "packed_kwargs", "prebuild_structures", "register",
    "release", "reset_counters", "resolve_backend", "varlen_available",
]
