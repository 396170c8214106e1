"""Seeded synthetic packed batches.

Document lengths are drawn from a configurable distribution (default log-normal with a median
near 300 tokens), clipped to the row, and packed greedily into rows of exactly ``seq_len``
tokens: the last document of a row is truncated to fill it. Every batch carries what a packed
training step needs plus the statistics the FLOPs model uses (documents, Σℓ, Σℓ²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.run.experiment import DataSpec
from optim.packing import PackedMetadata


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, -100 on the first token of each document
    position_ids: torch.Tensor  # (B, T) int64, restarting at 0 per document
    lengths: list[list[int]]  # per row, the document lengths (each row sums to T)

    @property
    def num_docs(self) -> int:
        return sum(len(r) for r in self.lengths)

    @property
    def sum_len(self) -> int:
        return sum(sum(r) for r in self.lengths)

    @property
    def sum_len_sq(self) -> int:
        return sum(l * l for r in self.lengths for l in r)

    def stats(self) -> dict:
        return {"num_docs": self.num_docs, "sum_len": self.sum_len, "sum_len_sq": self.sum_len_sq}

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            self.lengths,
        )


def draw_lengths(spec: DataSpec, seq_len: int, gen: torch.Generator) -> list[int]:
    """Document lengths for one row of ``seq_len`` tokens; they sum to exactly ``seq_len``."""
    out: list[int] = []
    remaining = seq_len
    while remaining > 0:
        if spec.distribution == "fixed":
            l = spec.median_doc_len
        elif spec.distribution == "uniform":
            hi = 2 * spec.median_doc_len - spec.min_doc_len
            l = int(torch.randint(spec.min_doc_len, max(spec.min_doc_len, hi) + 1, (1,), generator=gen))
        else:  # lognormal: median = exp(mu)
            z = float(torch.randn((1,), generator=gen))
            l = int(round(math.exp(math.log(spec.median_doc_len) + spec.sigma * z)))
        l = max(spec.min_doc_len, min(l, seq_len))
        l = min(l, remaining)
        out.append(l)
        remaining -= l
    return out


def make_batch(spec: DataSpec, seq_len: int, batch_size: int, vocab_size: int, step: int = 0) -> PackedBatch:
    """Batch number ``step`` of a seeded stream: the same arguments always give the same batch."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
    lengths = [draw_lengths(spec, seq_len, gen) for _ in range(batch_size)]
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    # the same metadata a packing collator builds: it validates the lengths and derives positions
    position_ids = PackedMetadata.from_lengths(lengths, seq_len).position_ids()
    labels = input_ids.clone()
    # The model shifts labels by one, so masking each document's first token stops the last
    # token of one document from being trained to predict the next document.
    labels[position_ids == 0] = -100
    return PackedBatch(input_ids, labels, position_ids, lengths)
