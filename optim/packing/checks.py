"""Packed inputs checked where they run, once per batch, without a host sync.

The ``position_ids`` a caller passes beside ``packing=`` (or beside ``cu_seq_lens_q``) must
restart at 0 at each of that metadata's document starts and count up by 1 inside a document;
otherwise the rotary positions and the attention's document boundaries disagree and the logits
are silently wrong. The comparison runs on the batch's device. On the CPU its answer is read at
once. On a GPU the comparison, and a copy of its four numbers into pinned host memory, are queued
on the stream behind an event, and the answer is read once the event has completed: when the
step's backward leaves the batch's first attention layer, when the next batch's metadata is
built, or at ``raise_pending(wait=True)``. A wrong batch therefore raises by the time the next
batch starts at the latest, and no step waits for the GPU. Switch ``validate`` (on by default)
turns the check off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class _Pending:
    found: torch.Tensor  # host int64 (4,): any disagreement, its flat token index, the position given, the expected
    ready: Callable[[], bool]
    wait: Callable[[], None]
    passed: str  # what the caller passed, for the message
    seq_len: int
    device: str


_PENDING: list[_Pending] = []


def compare(start: torch.Tensor, position_ids: torch.Tensor, passed: str) -> None:
    """Queue (on a GPU) or run (elsewhere) the check of ``position_ids`` against the documents
    whose row-local start index is ``start`` (B, T); ``passed`` names the metadata the caller gave."""
    B, T = start.shape
    device = start.device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # nothing queued into a graph: it would replay the check of one batch every step
    raise_pending()  # the answers already in: the list stays short where no backward reads it
    pos = position_ids if position_ids.dim() == 2 else position_ids.view(1, -1)
    if pos.shape[-1] != T or pos.shape[0] not in (1, B):
        raise ValueError(f"packing: position_ids of shape {tuple(position_ids.shape)} do not fit {passed}: "
                         f"{B} rows of {T} tokens")
    pos = pos.to(device).expand(B, T).reshape(-1).long()
    want = (torch.arange(T, device=device) - start).reshape(-1)
    wrong = pos != want
    first = torch.argmax(wrong.to(torch.uint8)).view(1)  # the first disagreement (0 when none)
    found = torch.cat([wrong.any().view(1).long(), first, pos.gather(0, first), want.gather(0, first)])
    if device.type == "cuda":
        host = torch.empty(4, dtype=torch.long, pin_memory=True)
        host.copy_(found, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        _PENDING.append(_Pending(host, event.query, event.synchronize, passed, T, str(device)))
        return
    _raise_if_wrong(_Pending(found.cpu(), lambda: True, lambda: None, passed, T, ""))


def raise_pending(wait: bool = False) -> None:
    """Read the answers of the checks the GPU has finished (all of them, waiting, with ``wait``),
    and raise ``ValueError`` for the first one that found a disagreement."""
    if not _PENDING or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return  # an event may not be queried while a CUDA graph is being captured
    done, left = [], []
    for p in _PENDING:
        if wait:
            p.wait()
        (done if wait or p.ready() else left).append(p)
    _PENDING[:] = left
    for p in done:
        _raise_if_wrong(p)


def pending() -> int:
    """How many queued checks have not been read yet."""
    return len(_PENDING)


def _raise_if_wrong(p: _Pending) -> None:
    wrong, index, given, expected = (int(v) for v in p.found.tolist())
    if not wrong:
        return
    row, token = divmod(index, p.seq_len)
    late = (f" This was found on {p.device} after the forward that used them had run: that step's outputs and "
            "gradients are wrong.") if p.device else ""
    if p.passed == "cu_seq_lens_q":
        what = "the position_ids beside cu_seq_lens_q (the caller's, or 0..T-1 counted by the model where none were passed)"
        fix = ("Pass position_ids that restart at each document, as DataCollatorWithFlattening(return_position_ids=True) "
               "and TRL's padding-free batches do")
    else:
        what = f"the position_ids passed with {p.passed}"
        fix = "Pass the metadata alone (enable fills position_ids in from it), or build them with PackedMetadata.position_ids()"
    raise ValueError(
        f"packing: {what} disagree with its documents at row {row}, token {token}: position {given}, where the "
        f"documents give {expected} (positions restart at 0 at each document start and count up by 1).{late} "
        f"{fix}; optim.enable(model, validate=False) skips this check.")
