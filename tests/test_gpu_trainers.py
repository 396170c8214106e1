"""On the GPU, 50 steps of Trainer and TRL SFTTrainer with optim.enable beside the stock run:
Qwen3-0.6B's real shape in bf16, the same seed and documents, the loss curves equal within bf16
tolerance, and each run's median step time printed (the figure a user sees; not judged here)."""

from importlib.metadata import version

import pytest
import torch
from packaging.version import Version
from harness.workload.trainers import documents, sft_run, trainer_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = "qwen3-0.6b"
STEPS = 50
RTOL = 2e-2  # bf16 weights and activations: a few ulps of the loss per step, compounding over 50


def _report(name: str, stock: dict, ours: dict) -> None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], stock["losses"]))
    print(f"\n{name}: step p50 stock {stock['step_ms']:.1f} ms, optim {ours['step_ms']:.1f} ms "
          f"({stock['step_ms'] / ours['step_ms']:.2f}x); peak {stock['peak_gib']:.2f} vs {ours['peak_gib']:.2f} GiB; "
          f"loss {stock['losses'][0]:.4f}->{stock['losses'][-1]:.4f} vs {ours['losses'][0]:.4f}->{ours['losses'][-1]:.4f}; "
          f"worst step rel diff {worst:.2e}")
    print(f"{name} losses stock: {[round(x, 4) for x in stock['losses']]}")
    print(f"{name} losses optim: {[round(x, 4) for x in ours['losses']]}")


def _check(stock: dict, ours: dict) -> None:
    assert len(ours["losses"]) == len(stock["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(ours["losses"], stock["losses"])):
        assert abs(a - b) <= RTOL * abs(b), (i, a, b)


@pytest.mark.parametrize("mode", ["padding_free", "packing"])
def test_sft_trainer_50_steps_beside_stock(tmp_path, mode):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")  # TRL's own dependency: a trl wheel installed without its deps lacks it
    docs = documents(STEPS * 8, 151936, 64, 1024)
    # padding-free: 8 documents (~4.4k tokens) per step; BFD packing: 2 rows of 4096 tokens
    kw = dict(mode=mode, steps=STEPS, batch_size=8 if mode == "padding_free" else 2, docs=docs, max_length=4096,
              device="cuda",
              dtype=torch.bfloat16, lora_rank=16, warmup=5)
    stock = sft_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = sft_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _report(f"SFTTrainer {mode}", stock, ours)
    _check(stock, ours)
    c = ours["counters"]
    if Version(version("trl")).release >= (1, 16):  # its collator hands cu_seq_lens_q and max_length_q
        assert c.get("from_cu_seqlens") == STEPS and "host_syncs" not in c, c
    else:  # TRL 1.15 (Unsloth's pin) hands position_ids only: one read of them per batch
        assert c["metadata"] == c.get("host_syncs") == STEPS and "from_cu_seqlens" not in c, c


def test_trainer_50_steps_beside_stock(tmp_path):
    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(STEPS * 8, 151936, 64, 1024)]
    kw = dict(steps=STEPS, batch_size=8, docs=docs, max_length=8192, device="cuda", dtype=torch.bfloat16,
              lora_rank=16, warmup=5)
    stock = trainer_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _report("Trainer + PackingCollator", stock, ours)
    _check(stock, ours)
