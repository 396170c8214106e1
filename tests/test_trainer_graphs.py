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


def test_a_batch_of_packing_metadata_reaches_the_graph_as_its_position_ids():
    """The graph refills tensors only: a batch that names its documents by ``packing=`` alone
    reaches the captured step with the position_ids that metadata gives, not as one document a row."""
    from optim.trainer import GraphedTrainer

    batch = PackingCollator(max_length=16, rows=2)([{"input_ids": [1, 2, 3]}, {"input_ids": [4] * 10}])
    meta = batch.pop("packing")
    given = batch.pop("position_ids")
    got = GraphedTrainer._device_inputs({**batch, "packing": meta})
    assert "packing" not in got and torch.equal(got["position_ids"], given)
    own = torch.zeros_like(given)
    assert GraphedTrainer._device_inputs({**batch, "packing": meta, "position_ids": own})["position_ids"] is own


def test_gradients_are_not_handed_to_another_set_of_parameters():
    """The captured gradients belong to the parameters trainable at capture; another set (a frozen
    adapter, set_adapter) must not receive them by position."""
    from optim.trainer import GraphedTrainer

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    trainer = GraphedTrainer.__new__(GraphedTrainer)  # its CUDA checks aside: only the hand-over is run
    trainer._graph_params = [p for p in model.parameters()]
    trainer._graph_grads = [torch.ones_like(p) for p in trainer._graph_params]
    trainer._accum = [torch.empty_like(p) for p in trainer._graph_params]
    trainer._accumulate(model)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    trainer._accumulate(model)  # the next micro-step of the cycle adds into the gradient
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())
    assert all(p.grad is acc for p, acc in zip(model.parameters(), trainer._accum))
    model[0].requires_grad_(False)
    with pytest.raises(CaptureError, match="trainable parameters changed after the step was captured"):
        trainer._accumulate(model)


def test_a_graphed_step_refuses_no_warm_up_and_a_learning_rate_changed_after_capture():
    """Without a warm-up step the capture would record the optimizer's state being made and replay
    it every step; a float lr is fixed in the captured step, so a scheduler's change is refused
    rather than ignored. A tensor lr is read at each replay."""
    from optim.graphs import GraphedStep, _float_lrs

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        GraphedStep(lambda: torch.zeros(()), opt, warmup=0)
    replays = []

    class Replayed:  # stands in for the captured optimizer graph: it only counts its replays
        def replay(self):
            replays.append(1)

    step = GraphedStep.__new__(GraphedStep)
    step.optimizer, step.graphs, step._captured_lr = opt, (None, None, Replayed()), _float_lrs(opt)
    step.optimizer_step()
    torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5).step()  # a scheduler halves the lr
    with pytest.raises(CaptureError, match="learning rate changed after the capture"):
        step.optimizer_step()
    assert len(replays) == 1
    tensor_lr = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(1e-3))
    assert _float_lrs(tensor_lr) == [None]


def test_the_nan_inf_filter_runs_on_the_device_and_trainer_skips_its_host_test_once():
    """Trainer's logging_nan_inf_filter without the host waiting for the replay: a non-finite loss
    becomes what Trainer's own filter adds in its place, and its host test of that micro-step is
    off only until Trainer's next call, ``floating_point_ops``."""
    from types import SimpleNamespace

    from optim.trainer import GraphedTrainer

    trainer = GraphedTrainer.__new__(GraphedTrainer)  # its CUDA checks aside: only the filter is run
    trainer.args = SimpleNamespace(logging_nan_inf_filter=True)
    trainer.state = SimpleNamespace(global_step=7)
    trainer.model = torch.nn.Linear(2, 2)
    trainer._globalstep_last_logged, trainer._tr_loss, trainer._filter_skipped = 4, torch.tensor(6.0), False
    assert trainer._filtered(torch.tensor(2.5)).item() == 2.5 and trainer.args.logging_nan_inf_filter is False
    trainer.floating_point_ops({"input_ids": torch.zeros(1, 3)})
    assert trainer.args.logging_nan_inf_filter is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert trainer._filtered(torch.tensor(bad)).item() == 6.0 / (1 + 7 - 4)  # Trainer's own substitute
        trainer._restore_filter()
    trainer.args.logging_nan_inf_filter = False  # the user's choice: no filter, nothing replaced
    nan = torch.tensor(float("nan"))
    assert trainer._filtered(nan) is nan and trainer.args.logging_nan_inf_filter is False
    del trainer._tr_loss  # a Trainer that keeps no running loss on the device: its own test runs
    trainer.args.logging_nan_inf_filter = True
    assert trainer._filtered(nan) is nan and trainer.args.logging_nan_inf_filter is True


def test_trainer_calls_floating_point_ops_right_after_its_nan_inf_test():
    """What GraphedTrainer's filter relies on in the installed transformers: the host test of the
    micro-step's loss is followed by ``floating_point_ops`` with no callback, save or step between."""
    import inspect

    import transformers.trainer as T

    src = inspect.getsource(T.Trainer)
    start = src.index("self.args.logging_nan_inf_filter")
    between = src[start:src.index("self.floating_point_ops(inputs)", start)]
    assert "self._tr_loss" in between
    assert not any(k in between for k in ("callback_handler", "training_step", "_save", "optimizer")), between
