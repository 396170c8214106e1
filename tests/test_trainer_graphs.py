"""GraphedTrainer's refusals that need no GPU, and the collator's fixed batch shape."""

import pytest
import torch

from optim.graphs import CaptureError
from optim.packing import PackingCollator


def test_fixed_rows_pad_with_empty_rows_and_refuse_an_overflow():
    batch = PackingCollator(max_length=16, rows=3)([{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 10}])
    assert batch["input_ids"].shape == (3, 16) and batch["packing"].lengths == ((3, 10, 3), (16,), (16,))
    assert batch["labels"][1:].eq(-100).all()
    with pytest.raises(ValueError, match="need 2 rows of 4 tokens, more than rows=1"):
        PackingCollator(max_length=4, rows=1)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    with pytest.raises(ValueError, match="needs max_length"):
        PackingCollator(rows=2)


def test_graphed_trainer_without_cuda_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_gpu_trainer_graphs.py covers the graphed Trainer")
    from transformers import TrainingArguments

    from harness.workload import models
    from optim.trainer import GraphedTrainer

    model = models.build(models.get("llama-3.2-1b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(CaptureError, match="no CUDA device is visible"):
        GraphedTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2]}])


def test_checkpointing_a_capture_cannot_take_is_refused_with_the_fix():
    from harness.workload import models
    from optim import offload
    from optim.graphs import check_checkpointing

    spec = models.get("llama-3.2-1b-tiny")
    rng = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2)  # torch's default: preserve the RNG
    with pytest.raises(CaptureError, match="preserve_rng_state=True"):
        check_checkpointing(rng)
    check_checkpointing(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2,
                                     checkpoint_preserve_rng=False))  # what a capture takes
    check_checkpointing(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2,
                                     gradient_checkpointing=False))
    off = offload.enable(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2), offload="double")
    with pytest.raises(CaptureError, match="leave optim.offload off"):
        check_checkpointing(off)
