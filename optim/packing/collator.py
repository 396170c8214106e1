"""``PackingCollator``: tokenized examples → packed rows with position_ids and the batch's
``PackedMetadata``, ready for ``model(**batch)`` and ``transformers.Trainer``."""

from __future__ import annotations

from typing import Any

import torch

from optim.packing.metadata import FORWARD_KWARG, PackedMetadata


class PackingCollator:
    """Pack a list of tokenized examples into rows of at most ``max_length`` tokens.

    Greedy first-fit in order; an example longer than ``max_length`` is truncated. Rows are as
    long as the batch's longest, rounded up to ``pad_to_multiple_of``; each row's free tail becomes
    one padding document (``pad_token_id``, labels -100), so every row has the same length.
    ``pad_to_max_length=True`` pads every batch to ``max_length`` instead (one shape for every
    batch, at the cost of computing the padding); ``rows`` fixes the number of rows and implies
    it (``optim.trainer.GraphedTrainer`` replays one shape). Labels are the input ids (or the
    example's ``labels``) with each document's first token set to -100, so no token learns to
    predict across a boundary. Returns ``input_ids``, ``labels``, ``position_ids`` (restarting at 0
    per document) and ``packing`` (a :class:`PackedMetadata`), ready for ``model(**batch)`` and
    ``transformers.Trainer`` (set ``remove_unused_columns=False``).
    """

    def __init__(self, max_length: int | None = None, pad_token_id: int = 0,
                 pad_to_multiple_of: int | None = None, label_pad_id: int = -100, rows: int | None = None,
                 pad_to_max_length: bool = False):
        for name, value in (("max_length", max_length), ("pad_to_multiple_of", pad_to_multiple_of),
                            ("rows", rows)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"packing: PackingCollator {name} must be a positive int, got {value!r}")
        if not isinstance(pad_to_max_length, bool):
            raise ValueError(f"packing: PackingCollator pad_to_max_length must be True or False, got {pad_to_max_length!r}")
        if (rows is not None or pad_to_max_length) and max_length is None:
            raise ValueError("packing: a fixed batch shape (rows= or pad_to_max_length=True) needs max_length")
        self.rows = rows  # every batch exactly this many rows (a replayed CUDA graph needs one shape)
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.label_pad_id = label_pad_id
        self.pad_to_max_length = pad_to_max_length or rows is not None

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
        if all(t == self.label_pad_id for _, labels in docs for t in labels):
            # each document's first token predicts nothing: one-token examples (or labels all masked)
            # leave no token to learn from, and the loss would be 0/0, NaN, into every gradient
            raise ValueError("packing: no token of this batch has a label to learn (every example is one token "
                             "long or its labels are all masked): its loss would be NaN; drop such examples")
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
        if self.rows is not None:
            if len(rows) > self.rows:
                raise ValueError(f"packing: these {len(docs)} examples need {len(rows)} rows of {self.max_length} "
                                 f"tokens, more than rows={self.rows}; lower the batch size or raise rows")
            rows += [[] for _ in range(self.rows - len(rows))]  # empty rows: one padding document each
            fill += [0] * (self.rows - len(fill))
        T = self.max_length if self.pad_to_max_length else max(fill)
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
