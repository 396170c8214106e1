"""Synthetic packed batches: rows sum to the sequence length, positions restart per document,
document boundaries are masked in the labels, and the stream is seeded."""

import torch

from harness.run.experiment import DataSpec
from harness.workload.data import make_batch


def test_rows_pack_exactly_and_positions_restart():
    b = make_batch(DataSpec(median_doc_len=100, seed=3), seq_len=1000, batch_size=3, vocab_size=50)
    assert b.input_ids.shape == b.labels.shape == b.position_ids.shape == (3, 1000)
    for row, lengths in enumerate(b.lengths):
        assert sum(lengths) == 1000 and min(lengths) >= 1
        starts = torch.nonzero(b.position_ids[row] == 0).flatten().tolist()
        expected_starts = [sum(lengths[:i]) for i in range(len(lengths))]
        assert starts == expected_starts
        # first token of every document is masked, nothing else is
        assert (b.labels[row] == -100).nonzero().flatten().tolist() == expected_starts
    assert b.num_docs == sum(len(r) for r in b.lengths)
    assert b.sum_len == 3000
    assert b.sum_len_sq == sum(l * l for r in b.lengths for l in r)


def test_lognormal_median_near_requested():
    lengths = []
    for step in range(40):
        b = make_batch(DataSpec(median_doc_len=300, sigma=1.0), 16384, 1, 10, step=step)
        lengths += b.lengths[0][:-1]  # the last document of a row is truncated to fit
    median = sorted(lengths)[len(lengths) // 2]
    assert 200 < median < 420, median


def test_seeded_and_distinct_per_step():
    spec = DataSpec(seed=7)
    a, b = make_batch(spec, 512, 2, 100, step=1), make_batch(spec, 512, 2, 100, step=1)
    assert torch.equal(a.input_ids, b.input_ids) and a.lengths == b.lengths
    c = make_batch(spec, 512, 2, 100, step=2)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_long_documents_are_clipped_to_the_row():
    b = make_batch(DataSpec(distribution="fixed", median_doc_len=5000), 1024, 1, 10)
    assert b.lengths == [[1024]]


def test_position_ids_restart_per_document():
    b = make_batch(DataSpec(distribution="fixed", median_doc_len=3), 7, 1, 10)
    assert b.lengths == [[3, 3, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
