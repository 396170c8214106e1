"""The attention structures of a packed batch, each built from its device metadata (``metadata.Entry``)
and cached on it: the additive SDPA mask, the flex ``BlockMask`` and the varlen arguments."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from optim.packing.metadata import COUNTERS, FLEX_BLOCK, Entry

def cached_structure(entry: Entry, key: tuple, build, cache: bool):
    if cache and key in entry.structures:
        return entry.structures[key]
    value = build()
    if cache:
        entry.structures[key] = value
    return value


def _allowed(entry: Entry, window: int | None) -> torch.Tensor:
    """(B, T, T) bool: same document, causal, and inside the sliding window. Broadcast, no loop."""
    idx = torch.arange(entry.T, device=entry.doc.device)
    ok = (entry.doc[:, :, None] == entry.doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        ok &= (idx[:, None] - idx[None, :]) < window
    return ok


def build_sdpa_mask(entry: Entry, window: int | None, dtype: torch.dtype, sink_cols: int) -> torch.Tensor:
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


def build_flex_block_mask(entry: Entry, window: int | None):
    """Document (+window) causal BlockMask built at block granularity: O((T/128)²), no T×T.

    For query t the visible keys are one interval [lo(t), t], lo(t) = max(doc start, t-w+1),
    and lo is non-decreasing, so a query block [qa, qb] sees the key interval [lo(qa), qb]; a key
    block [ka, kb] is fully visible iff kb <= qa and ka >= lo(qb). Visible-but-not-full blocks are
    partial and get the mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    COUNTERS["flex_block_mask"] += 1
    T, dev = entry.T, entry.doc.device
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


def build_varlen_args(entry: Entry) -> tuple[torch.Tensor, int]:
    """varlen takes the metadata as is: int32 cu_seqlens on device and a host max_seqlen."""
    if entry.cu_seqlens is None:
        raise ValueError("packing: the varlen kernel needs the batch's max_seqlen on the host, which "
                         "position_ids read inside a CUDA-graph capture cannot give; capture with "
                         "packing_backend='flex' or 'sdpa', or hand the model packing=PackedMetadata")
    COUNTERS["varlen_args"] += 1
    return entry.cu_seqlens, entry.max_seqlen
