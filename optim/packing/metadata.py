"""Packed-batch metadata (lengths, cu_seqlens, max_seqlen, document ids) and its per-device
cache; ``structures`` builds the attention structures from a cached entry once per batch. The
counters say how often each was built."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import os
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from optim.packing import checks
from optim.switches import PACKING_BACKENDS

ATTN_NAME = "optim_packed"
FORWARD_KWARG = "packing"  # the model forward kwarg that carries a PackedMetadata
# Prebuilt flex BlockMasks per sliding window, handed to compiled layers (see prebuild_structures)
STRUCTURES_KWARG = "packing_structures"
FLEX_BLOCK = 128  # flex_attention's default sparse block size
BACKENDS = PACKING_BACKENDS

# Build and sync counters: what the bench reports per training step ("count, don't assume").
COUNTERS: collections.Counter = collections.Counter()
# Calls per attention kernel that actually ran on the eager path: "flex-fused", "flex-unfused"
# (CPU only), "varlen", "sdpa-mask", "sdpa-causal" (rows of one document each). Kernels traced into
# compiled layers (optim.regional) run inside the layer's graph and are not counted here; the
# batches that ran each are (COUNTERS "flex_batches", "causal_batches").
KERNEL_CALLS: collections.Counter = collections.Counter()
# Raised by optim.graphs around a CUDA-graph's warm-up and capture: no kernel choice from host lengths
CAPTURE_PATHS = {"depth": 0}


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
# A serial names one batch's metadata for the cache. A DataLoader worker forked from this process
# inherits the counter, so two workers would number their batches alike: each process draws its own
# prefix (at import, and again in a forked child), and a serial is (prefix, count).
_PREFIX = [secrets.randbits(62)]


def _new_prefix() -> None:
    _PREFIX[0] = secrets.randbits(62)


os.register_at_fork(after_in_child=_new_prefix)


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
    serial: tuple = field(default_factory=lambda: (_PREFIX[0], next(_serials)), compare=False)
    # "lengths" (the caller's documents: position_ids must restart at each) or "attention_mask"
    # (a padded batch's runs of real and padding tokens: position_ids are the caller's own)
    source: str = field(default="lengths", compare=False)

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
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        if len(lengths) and not isinstance(lengths[0], (list, tuple)):
            lengths = [lengths]  # type: ignore[list-item]
        rows = tuple(tuple(_count(l, "a document length") for l in row) for row in lengths)  # type: ignore[union-attr]
        if not rows:
            raise ValueError("packing: no rows")
        T = sum(rows[0]) if seq_len is None else _count(seq_len, "seq_len", 1)
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
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> "PackedMetadata | None":
        """The documents of a padded batch: in each row its real tokens (1) form one document and
        each run of padding (0) another, so every real token attends to exactly the real tokens
        before it, as stock attention with that mask does. None when nothing is padded. One
        device-to-host read of the mask. Padding inside a row's real tokens, which stock attends
        across, has no such form and is refused."""
        return padding_documents(attention_mask)[0]

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


def padding_documents(attention_mask: torch.Tensor) -> tuple[PackedMetadata | None, bool]:
    """``PackedMetadata.from_attention_mask``, and whether a row starts with padding (left
    padding: a padding position then precedes, and predicts, the row's first real token)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"packing: attention_mask must be a (batch, seq_len) tensor here, got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    real = (attention_mask != 0).cpu()
    if attention_mask.device.type != "cpu":
        COUNTERS["host_syncs"] += 1
    COUNTERS["attention_mask_reads"] += 1
    if bool(real.all()):
        return None, False
    B, T = real.shape
    change = torch.ones(B, T, dtype=torch.bool)
    change[:, 1:] = real[:, 1:] != real[:, :-1]
    rows = []
    for r in range(B):
        starts = torch.nonzero(change[r]).flatten()
        if int(real[r][starts].sum()) > 1:
            raise ValueError(f"packing: attention_mask row {r} has padding between its real tokens "
                             f"({real[r].int().tolist()[:32]}...); optim's packed attention takes left "
                             "or right padding, or packed rows with position_ids restarting per "
                             "document (no attention_mask)")
        rows.append(torch.diff(starts, append=torch.tensor([T])).tolist())
    meta = dataclasses.replace(PackedMetadata.from_lengths(rows, T), source="attention_mask")
    return meta, bool((~real[:, 0] & real.any(1)).any())


def _count(value, what: str, minimum: int | None = None) -> int:
    """An integer count (a Python or numpy int, or a one-element integral tensor), never a float
    or a string silently truncated; at least ``minimum`` where given."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"packing: {what} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"packing: {what} must be at least {minimum}, got {value}")
    return int(value)


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
class Entry:
    """Device metadata of one batch plus the attention structures built from it."""

    key: tuple
    B: int
    T: int
    cu_seqlens: torch.Tensor | None  # int32 (num_docs+1,) on device over the flattened batch; None:
    max_seqlen: int | None  # host int   # built from position_ids inside a CUDA-graph capture
    doc: torch.Tensor  # int32 (B, T): global document index of each token
    start: torch.Tensor  # int64 (B, T): row-local index of the token's document start
    structures: dict = field(default_factory=dict)
    pos_ref: Any = None  # weakref to the position_ids the entry was keyed on
    first_module: int | None = None  # id() of the attention module that owns (releases) the entry
    first_layer: int | None = None  # its layer_idx
    owner_grad: bool = False  # whether it took the entry in a call that records a backward


_CACHE: dict[torch.device, Entry] = {}


def release(device: torch.device | str | None = None) -> None:
    """Drop the cached entry for ``device`` (all devices if None)."""
    if device is None:
        _CACHE.clear()
    else:
        _CACHE.pop(torch.device(device), None)


def cached_entry(device: torch.device | str) -> Entry | None:
    """The entry cached for ``device`` (for tests and benchmarks)."""
    return _CACHE.get(_canonical(torch.device(device)))


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` are one cache slot: key on the indexed form."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def build_entry(key: tuple, meta: PackedMetadata, device: torch.device) -> Entry:
    """Device metadata from the host lengths: one small host-to-device copy, no sync."""
    COUNTERS["metadata"] += 1
    cu_host = meta.cu_seqlens()
    if device.type == "cuda":
        cu_host = cu_host.pin_memory()
    cu = cu_host.to(device, non_blocking=True)
    return _entry_on_device(key, cu, meta.max_seqlen, meta.batch_size, meta.seq_len)


def _entry_on_device(key: tuple, cu: torch.Tensor, max_seqlen: int, B: int, T: int) -> Entry:
    """The per-token document index and document start from int32 ``cu`` offsets already on the
    device: mark the starts, cumsum. Vectorized, no loop per document, no sync."""
    n, device = B * T, cu.device
    starts = cu[1:-1].long()
    seg = torch.zeros(n + 1, dtype=torch.int32, device=device)  # slot n takes starts at the very end
    # scatter_add_, not seg[idx] = 1: advanced-index assignment checks its indices with a sync, and
    # a zero-length document repeats an offset and must still count as one document
    seg.scatter_add_(0, starts, torch.ones_like(starts, dtype=seg.dtype))
    doc = torch.cumsum(seg[:n], 0, dtype=torch.int32)
    row0 = (torch.arange(n, device=device) // T) * T
    start = cu[doc.long()].long() - row0
    return Entry(key, B, T, cu, int(max_seqlen), doc.view(B, T), start.view(B, T))


def entry_from_cu_seqlens(key: tuple, cu_seqlens: torch.Tensor, max_seqlen: int, B: int, T: int,
                          device: torch.device) -> Entry:
    """Device metadata from ``cu_seqlens`` offsets over the flattened (B*T) batch and a host
    ``max_seqlen``, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` and TRL's
    padding-free batches carry them (``cu_seq_lens_q``, ``max_length_q``): built on the device
    with no host sync, so the batch's lengths never travel back. Checked where that is free
    (offsets on the CPU)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"packing: cu_seq_lens must be 1-D offsets [0, ..., B*T], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"packing: cu_seq_lens must be integer offsets, got {cu_seqlens.dtype}: "
                         "a cast would round document boundaries")
    if cu_seqlens.device.type == "cpu":
        lens = torch.diff(cu_seqlens.long())
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != B * T or bool((lens < 0).any()):
            raise ValueError(f"packing: cu_seq_lens {cu_seqlens.tolist()[:8]}... must rise from 0 to the "
                             f"batch's {B}x{T} = {B * T} tokens")
        if int(lens.max()) > int(max_seqlen):
            raise ValueError(f"packing: max_length {max_seqlen} is below the longest document ({int(lens.max())})")
    COUNTERS["metadata"] += 1
    COUNTERS["from_cu_seqlens"] += 1
    cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return _entry_on_device(key, cu, max_seqlen, B, T)


def entry_from_position_ids(key: tuple, position_ids: torch.Tensor, B: int, T: int, device: torch.device) -> Entry:
    """Device metadata from position ids restarting at 0 per document, computed on the device with
    fixed shapes and no host sync: what a CUDA graph can capture, so one graph replays batches whose
    document lengths differ (the caller refills the static position_ids). The positions are trusted
    (checking them needs a sync), and there are no ``cu_seqlens``/``max_seqlen``: varlen needs them
    on the host, so it cannot run from these."""
    COUNTERS["metadata"] += 1
    COUNTERS["from_position_ids_on_device"] += 1
    pos = (position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)).to(device)
    pos = pos.expand(B, T).long()
    doc = torch.cumsum((pos == 0).flatten(), 0, dtype=torch.int32).view(B, T) - 1
    start = torch.arange(T, device=device) - pos  # row-local index of the token's document start
    return Entry(key, B, T, None, None, doc, start)


def entry_for(packing, position_ids, B: int, T: int, device: torch.device, cache: bool,
               validate: bool, cu_seqlens: torch.Tensor | None = None, max_seqlen=None) -> Entry:
    """The batch's entry: from the cache when the batch is the cached one, else built from (in
    this order) ``packing``, ``cu_seqlens`` with ``max_seqlen``, or ``position_ids``."""
    from_cu = packing is None and cu_seqlens is not None and max_seqlen is not None
    # Inside a CUDA-graph capture the boundaries come from position_ids on the device, never from an
    # entry built before it (that would freeze one batch's lengths into the graph).
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if packing is not None:
        if not isinstance(packing, PackedMetadata):
            raise TypeError(f"packing= must be a PackedMetadata, got {type(packing).__name__}")
        key = ("meta", packing.serial)
        pos_ref = None
    elif from_cu:
        key = ("cu", id(cu_seqlens), cu_seqlens._version)
        pos_ref = weakref.ref(cu_seqlens)
    elif position_ids is not None:
        key = ("pos-captured" if capturing else "pos", id(position_ids), position_ids._version)
        pos_ref = weakref.ref(position_ids)
    else:
        raise ValueError("packed attention needs packing=PackedMetadata, cu_seq_lens_q with "
                         "max_length_q, or position_ids")

    if cache:
        hit = _CACHE.get(device)
        if hit is not None and hit.key == key and (hit.B, hit.T) == (B, T) and (
                pos_ref is None or hit.pos_ref() is (cu_seqlens if from_cu else position_ids)):
            COUNTERS["cache_hits"] += 1
            if validate and position_ids is not None:
                _check(hit, packing, position_ids, from_cu)  # the batch's metadata, maybe with other positions
            return hit
    checks.raise_pending()  # a new batch: what the GPU found in an earlier one's inputs, if it has

    if from_cu:
        if isinstance(max_seqlen, torch.Tensor) and max_seqlen.device.type != "cpu":
            COUNTERS["host_syncs"] += 1  # pass max_length_q as a host int, as the collators do
        entry = entry_from_cu_seqlens(key, cu_seqlens, int(max_seqlen), B, T, device)
    elif packing is None and capturing:
        entry = entry_from_position_ids(key, position_ids, B, T, device)  # no sync: capturable
    else:
        if packing is None:
            pos = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
            meta = PackedMetadata.from_lengths(_lengths_from_position_ids(pos), T)
            if meta.batch_size == 1 and B > 1:  # (1, T) positions shared by every row
                meta = PackedMetadata.from_lengths([meta.lengths[0]] * B, T)
        else:
            meta = packing
        if meta.batch_size != B or meta.seq_len != T:
            raise ValueError(f"packing: metadata describes {meta.batch_size}x{meta.seq_len} tokens but "
                             f"the batch is {B}x{T}")
        entry = build_entry(key, meta, device)
    if validate and position_ids is not None:
        _check(entry, packing, position_ids, from_cu)
    entry.pos_ref = pos_ref
    if cache:
        _CACHE[_canonical(device)] = entry  # a new batch replaces the old one on this device
    return entry


# Set by routing on the position_ids it made from a batch's metadata: the key of that metadata.
FILLED_FROM = "_optim_packing_filled_from"
# Per device, the metadata key and the positions (weakref, _version) last checked: each batch's are
# checked once, whether its entry is cached or (cache off) rebuilt in every layer call.
_CHECKED: dict[torch.device, tuple] = {}


def _check(entry: Entry, packing, position_ids: torch.Tensor, from_cu: bool) -> None:
    """The caller's positions against the metadata they came with (a padded mask's documents, and
    metadata read from the positions themselves, need none), once per batch."""
    if not (from_cu or (packing is not None and packing.source == "lengths")):
        return
    device = _canonical(entry.doc.device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # a graph replays other batches: their positions are the caller's to refill
    if getattr(position_ids, FILLED_FROM, None) == entry.key:
        return  # made from this very metadata (routing)
    last = _CHECKED.get(device)
    if last is not None and last[0] == entry.key and last[1]() is position_ids and last[2] == position_ids._version:
        return
    COUNTERS["position_id_checks"] += 1
    checks.compare(entry.start, position_ids, "cu_seq_lens_q" if from_cu else f"packing={packing!r}")
    _CHECKED[device] = (entry.key, weakref.ref(position_ids), position_ids._version)


class ReleaseOnBackward(torch.autograd.Function):
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
        checks.raise_pending()  # the batch's inputs, if the GPU has checked them by now: before the optimizer steps
        return grad, None, None
