"""optim.trainer.GraphedTrainer on the GPU: Trainer's own optimizer, LR schedule, clipping and
gradient accumulation around a replayed forward + backward; the loss curve equals the eager
Trainer's within bf16 tolerance while the document lengths vary batch to batch; a batch of
another shape is refused with the reason."""

import warnings

import pytest
import torch
from harness.workload.trainers import documents, trainer_run

from optim._syncs import is_sync_warning

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 20


class _Syncs:
    """A TrainerCallback recording, as torch's sync debug mode reports them, the host syncs of the
    optimizer steps ``first`` .. ``last - 1`` (Trainer's own work between them included)."""

    def __init__(self, first: int, last: int):
        from transformers import TrainerCallback

        self.seen: list[str] | None = None  # None until the window has closed
        self._catch = None
        rec = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == first:
                    torch.cuda.synchronize()
                    rec._catch = warnings.catch_warnings(record=True)
                    rec._log = rec._catch.__enter__()
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == last:
                    rec.close()
                    rec.seen = [f"{w.filename}:{w.lineno}" for w in rec._log
                                if is_sync_warning(w)]

        self.callback = _Callback()

    def close(self) -> None:
        """Sync debug mode off and the warnings filter back (also where training ended inside the window)."""
        torch.cuda.set_sync_debug_mode(0)
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None


def test_graphed_trainer_matches_the_eager_trainer(tmp_path):
    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(STEPS * 2 * 6, 151936, 64, 1200)]
    kw = dict(ours=True, steps=STEPS, batch_size=6, docs=docs, max_length=8192, rows=1, accumulation=2,
              device="cuda", dtype=torch.bfloat16, lora_rank=16, warmup=5)
    eager = trainer_run("qwen3-0.6b", out_dir=str(tmp_path / "e"), **kw)
    syncs = _Syncs(10, 14)  # replayed steps: the capture is at the third optimizer step
    try:
        graphed = trainer_run("qwen3-0.6b", out_dir=str(tmp_path / "g"), graphed=True, callbacks=[syncs.callback], **kw)
    finally:
        syncs.close()
    worst = max(abs(a - b) / abs(b) for a, b in zip(graphed["losses"], eager["losses"]))
    print(f"\nGraphedTrainer: step p50 eager {eager['step_ms']:.1f} ms, graphed {graphed['step_ms']:.1f} ms "
          f"({eager['step_ms'] / graphed['step_ms']:.2f}x); peak {eager['peak_gib']:.2f} vs {graphed['peak_gib']:.2f} GiB; "
          f"worst step rel diff {worst:.2e}\neager  {[round(x, 4) for x in eager['losses']]}\n"
          f"graphed {[round(x, 4) for x in graphed['losses']]}")
    assert len(graphed["losses"]) == len(eager["losses"]) == STEPS
    assert worst < 2e-2
    assert graphed["counters"].get("from_position_ids_on_device", 0) >= 1, graphed["counters"]
    # the captured step keeps the eager pass's decision: it recomputes no layer the eager steps skip
    # (the Python of the step runs once, at the capture: a kept recompute would count once more)
    rs_e, rs_g = eager["recompute_stats"], graphed["recompute_stats"]
    assert rs_e["layers_skipped"]["last"] > 0, rs_e
    assert rs_g["recomputes"] == rs_e["recomputes"] and rs_g["layers_skipped"] == rs_e["layers_skipped"], (rs_e, rs_g)
    # the host never waits for a replay: the NaN/Inf filter runs on the device, batches copy without
    # a sync; what torch's sync debug mode reports (.item(), bool(tensor), blocking copies)
    assert syncs.seen is not None, "the replayed steps' window never closed"
    assert syncs.seen == [], syncs.seen


def test_a_batch_of_another_shape_is_refused(tmp_path):
    from optim.graphs import CaptureError

    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(64, 512, 8, 60)]
    with pytest.raises(CaptureError, match="pad every batch to one shape"):
        # rows not fixed: the collator makes as many rows as the examples need
        trainer_run("qwen3-0.6b-tiny", ours=True, steps=12, batch_size=8, docs=docs, max_length=64, device="cuda",
                    dtype=torch.bfloat16, out_dir=str(tmp_path), graphed=True)
