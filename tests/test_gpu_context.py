"""Numerics at length on CUDA: Qwen3-0.6B's shape (28 layers), bf16, LoRA r=16 on every linear
layer, one 65536-token document per step. What optim needs for length (every recompute kept,
checkpoints in pinned host memory reloaded double-buffered, MLPs in 4096-token chunks) against plain
checkpointing (transformers' own, torch.utils.checkpoint): at each of three steps on the same weights,
the first included, the loss and every LoRA gradient stay within bf16 tolerance, and the layer
inputs really lived on the host."""

import pytest
import torch
from _lora import cuda_lora_model, measured_step

import optim
import optim.offload
from harness.run.experiment import DataSpec
from harness.workload import models
from harness.workload.data import make_batch

pytestmark = pytest.mark.gpu

MODEL, TOKENS = "qwen3-0.6b", 65536


def _step(model, b):
    model.zero_grad(set_to_none=True)
    return measured_step(model, b)


def test_length_switches_match_plain_checkpointing_at_65536_tokens_each_step():
    spec = models.get(MODEL)
    # the reference keeps transformers' checkpointing; only the loss is optim's, so its logits fit
    ref = optim.enable(cuda_lora_model(MODEL), only=("loss",))
    long = optim.enable(cuda_lora_model(MODEL), recompute="all", offload="double", mlp_chunk=4096,
                        offload_profile=True)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4)
    for step in range(3):
        b = make_batch(DataSpec(distribution="fixed", median_doc_len=1 << 20, seed=step), TOKENS, 1,
                       spec.vocab_size).to("cuda")
        assert b.num_docs == 1
        ref_loss, ref_grads, ref_peak, ref_ms = _step(ref, b)
        loss, grads, peak, ms = _step(long, b)
        worst = max(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items() if g.norm() > 0)
        print(f"step {step}: loss {ref_loss:.5f} / {loss:.5f}, worst LoRA grad relative difference {worst:.4f}, "
              f"peak above start GiB {ref_peak:.2f} / {peak:.2f}, ms {ref_ms:.0f} / {ms:.0f}")
        assert abs(loss - ref_loss) / ref_loss < 2e-3, (step, loss, ref_loss)
        assert set(grads) == set(ref_grads) and len(grads) == 7 * 2 * spec.num_hidden_layers
        assert worst < 3e-2, (step, worst)
        opt.step()
        with torch.no_grad():
            for p, q in zip(long.parameters(), ref.parameters()):
                p.copy_(q)
    st = optim.offload.get(long).stats()
    # every layer input but the embedding output (a leaf autograd holds) and the last layer's
    n = spec.num_hidden_layers - 2
    assert st["effective_mode"] == "double" and st["offloaded"] == n and st["host_pinned"] is True
    assert st["bytes_offloaded"] == n * TOKENS * spec.hidden_size * 2
    assert len(st["reload_ms"]) == n and len(st["backward_ms"]) == spec.num_hidden_layers
    assert optim.enabled(long)["optim.mlp"]["chunked_calls"] > 0
