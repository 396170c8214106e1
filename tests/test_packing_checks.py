"""The caller's position_ids checked against the metadata they came with (optim.packing.checks):
once per batch, on the batch's device; on a GPU without a host sync (tests/test_gpu_packing.py)."""

from __future__ import annotations

import pytest
import torch

import optim
import optim.packing as P
from optim.packing import checks
from harness.workload import models

LENGTHS = [[3, 5], [8]]


@pytest.fixture(scope="module")
def model():
    m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4,
                     gradient_checkpointing=True)
    optim.enable(m)
    return m


def _batch(lengths=LENGTHS):
    meta = P.PackedMetadata.from_lengths(lengths)
    ids = torch.randint(0, 512, (meta.batch_size, meta.seq_len), generator=torch.Generator().manual_seed(0))
    return ids, meta, meta.position_ids()


def test_positions_that_disagree_with_packing_are_named_with_row_and_token(model):
    ids, meta, pos = _batch()
    P.reset_counters()
    model(input_ids=ids, labels=ids, position_ids=pos, packing=meta).loss.backward()
    assert P.counters()["position_id_checks"] == 1  # once per batch: not per layer, not per recompute

    bad = pos.clone()
    bad[1, 6] = 0
    with pytest.raises(ValueError, match=r"position_ids passed with packing=PackedMetadata\(rows=2, seq_len=8, "
                                         r"docs=3.*at row 1, token 6: position 0, where the documents give 6"):
        model(input_ids=ids, labels=ids, position_ids=bad, packing=meta)
    # the same metadata object again (a cache hit), with other positions: checked again
    model(input_ids=ids, position_ids=pos, packing=meta)
    with pytest.raises(ValueError, match="at row 0, token 3"):
        model(input_ids=ids, position_ids=torch.arange(8).expand(2, 8), packing=meta)
    # one (1, T) row of positions shared by every row is checked against each row
    with pytest.raises(ValueError, match="at row 1, token 3: position 0"):
        model(input_ids=ids, position_ids=pos[:1], packing=meta)
    P.release()


def test_packing_alone_gets_its_positions_filled_in_and_passes(model):
    ids, meta, _ = _batch()
    P.reset_counters()
    model(input_ids=ids, labels=ids, packing=meta).loss.backward()
    c = P.counters()
    # positions made from the metadata itself are not compared with it
    assert c["position_ids_from_metadata"] == 1 and "position_id_checks" not in c, c
    P.release()


def test_with_the_cache_off_a_batch_is_still_checked_once(model):
    ids, meta, pos = _batch()
    try:
        optim.enable(model, packing_cache=False)
        P.reset_counters()
        model(input_ids=ids, labels=ids, position_ids=pos, packing=meta).loss.backward()
        c = P.counters()
        assert c["metadata"] > 2 and c["position_id_checks"] == 1, c  # rebuilt per layer call, checked once
        bad = pos.clone()
        bad[0, 5] = 9
        with pytest.raises(ValueError, match="at row 0, token 5: position 9"):
            model(input_ids=ids, position_ids=bad, packing=meta)
    finally:
        optim.enable(model)
        P.release()


def test_positions_beside_cu_seq_lens_are_checked(model):
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(
        [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 4)])
    model(**batch)
    P.release()
    bad = batch["position_ids"].clone()
    bad[0, 3] = 3  # the second document's start continues the first
    with pytest.raises(ValueError, match=r"position_ids beside cu_seq_lens_q \(the caller's, or 0..T-1 counted .*\) "
                                         r"disagree .* at row 0, token 3: position 3, where the documents give 0.*"
                                         r"\(return_position_ids=True\)"):
        model(**dict(batch, position_ids=bad))
    P.release()


def test_validate_off_trusts_the_positions_from_enable_and_from_the_environment(model, monkeypatch):
    ids, meta, pos = _batch()
    bad = torch.arange(8).expand(2, 8)
    try:
        optim.enable(model, validate=False)
        assert optim.enabled(model)["optim.packing"]["validate"] is False
        P.reset_counters()
        model(input_ids=ids, position_ids=bad, packing=meta)
        assert "position_id_checks" not in P.counters()
        monkeypatch.setenv("OPTIM_VALIDATE", "1")
        optim.enable(model)
        with pytest.raises(ValueError, match="disagree"):
            model(input_ids=ids, position_ids=bad, packing=meta)
        with pytest.raises(ValueError, match="validate=2 is not valid"):
            optim.enable(model, validate=2)
    finally:
        monkeypatch.delenv("OPTIM_VALIDATE", raising=False)
        optim.enable(model)
        P.release()


def test_a_check_the_device_has_not_finished_is_read_later_and_raises_once():
    """The GPU's answers are read when ready: a finished check raises, an unfinished one waits for
    the next read, and wait=True reads all of them."""
    ready = {"now": False}
    found = torch.tensor([1, 11, 5, 0])
    checks._PENDING.append(checks._Pending(found, lambda: ready["now"], lambda: ready.update(now=True),
                                           "packing=X", 8, "cuda:0"))
    try:
        checks.raise_pending()  # not finished: nothing read, nothing raised
        assert checks.pending() == 1
        ready["now"] = True
        with pytest.raises(ValueError, match=r"with packing=X .* at row 1, token 3: position 5, .* found on cuda:0 "
                                             r"after the forward that used them had run"):
            checks.raise_pending()
        assert checks.pending() == 0
        checks.raise_pending()  # read once: no second error

        ready["now"] = False
        checks._PENDING.append(checks._Pending(torch.tensor([0, 0, 0, 0]), lambda: ready["now"],
                                               lambda: ready.update(now=True), "packing=Y", 8, "cuda:0"))
        checks.raise_pending(wait=True)  # waited for, agreed: nothing raised
        assert checks.pending() == 0 and ready["now"]
    finally:
        checks._PENDING.clear()


def test_positions_of_the_wrong_shape_are_refused_before_the_model_runs():
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    entry = P.build_entry(("meta", meta.serial), meta, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"position_ids of shape \(2, 7\) do not fit packing=M: 2 rows of 8"):
        checks.compare(entry.start, torch.zeros(2, 7, dtype=torch.long), "packing=M")


def test_a_batch_with_no_label_to_learn_and_float_offsets_are_refused():
    """One-token examples leave every label masked: the loss would be 0/0, NaN in every gradient.
    Float cu_seq_lens would be rounded into other document boundaries by a cast."""
    from optim.packing import PackingCollator
    from optim.packing.metadata import entry_from_cu_seqlens

    with pytest.raises(ValueError, match="no token of this batch has a label to learn"):
        PackingCollator(max_length=16)([{"input_ids": []}, {"input_ids": [5]}, {"input_ids": [7]}])
    assert PackingCollator(max_length=16)([{"input_ids": [5]}, {"input_ids": [7, 8]}])["labels"].tolist() == [[-100, -100, 8]]
    with pytest.raises(ValueError, match="must be integer offsets, got torch.float32"):
        entry_from_cu_seqlens(("k",), torch.tensor([0.0, 3.5, 8.0]), 5, 1, 8, torch.device("cpu"))
