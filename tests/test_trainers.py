"""optim.enable in transformers.Trainer and TRL's SFTTrainer, for real: the same losses as the
stock run step by step, and the packing metadata taken from what each collator hands over."""

import pytest
import torch
from harness.workload.trainers import documents, sft_run, trainer_run

pytestmark = pytest.mark.slow
MODEL = "qwen3-0.6b-tiny"


def _close_curves(ours: list[float], stock: list[float], rtol: float) -> None:
    assert len(ours) == len(stock) > 0
    for i, (a, b) in enumerate(zip(ours, stock)):
        assert abs(a - b) <= rtol * abs(b), (i, a, b)


@pytest.mark.parametrize("mode", ["padding_free", "packing"])
def test_sft_trainer_with_peft_config_then_enable_matches_stock(tmp_path, mode):
    pytest.importorskip("trl")
    docs = documents(48, 512, 5, 60)
    kw = dict(mode=mode, steps=4, batch_size=4, docs=docs, max_length=128)
    stock = sft_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = sft_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _close_curves(ours["losses"], stock["losses"], 1e-4)
    assert set(ours["enabled"]) >= {"optim.packing", "optim.loss"}
    # both hand cu_seq_lens_q/max_length_q (BFD packing is padding-free too): no position_ids read
    c = ours["counters"]
    assert c["from_cu_seqlens"] == c["metadata"] == 4 and "position_id_reads" not in c, c


def test_trainer_with_the_packing_collator_matches_stock_flattening(tmp_path):
    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(48, 512, 5, 30)]
    kw = dict(steps=4, batch_size=4, docs=docs, max_length=128)
    stock = trainer_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _close_curves(ours["losses"], stock["losses"], 1e-4)
    c = ours["counters"]
    assert c["metadata"] == 4 and "position_id_reads" not in c, c  # the collator's host lengths
    assert torch.isfinite(torch.tensor(ours["losses"])).all()
