"""Numerics at length on CUDA: Qwen3-0.6B's layer shape with 8 of its 28 layers (six layer inputs
offloaded, so the two staging buffers are each reused three times), LoRA r=16 on every linear
layer, one 65536-token document per step. What optim needs for length (every recompute kept, checkpoints in
pinned host memory reloaded double-buffered, MLPs in 4096-token chunks, and the attention backward
split by heads) against plain GPU checkpointing with the attention backward whole, the rest of
``optim.enable``'s defaults the same on both sides.

Both sides run in bf16 and may round differently (the chunked MLP runs eager, the plain one in the
compiled layer), so their difference alone cannot say which is off. Each is judged against the
truth instead: the plain path in fp32 on the same weights. At each of two steps, the first
included, the length switches' loss and LoRA gradients may be no further from fp32 than the plain bf16
path's are (twice its error, plus a floor), and the layer inputs really lived on the host."""

import copy
import dataclasses

import pytest
import torch
from _lora import cuda_lora_model, measured_step

import optim
import optim.offload
import optim.packing
from harness.run.experiment import DataSpec
from harness.workload import models
from harness.workload.data import make_batch

pytestmark = pytest.mark.gpu

TOKENS = 65536
# every layer of the real shape but fewer of them: the fp32 side at 65536 tokens costs tens of seconds a layer
SPEC = dataclasses.replace(models.get("qwen3-0.6b"), name="qwen3-0.6b-8l", num_hidden_layers=8)


def _step(model, b):
    model.zero_grad(set_to_none=True)
    return measured_step(model, b)


def _error(grads: dict, truth: dict) -> tuple[float, float, str]:
    """All LoRA gradients' relative distance from ``truth`` together, and the worst single one."""
    diff = sum((grads[n] - g).square().sum() for n, g in truth.items()).sqrt()
    whole = (diff / sum(g.square().sum() for g in truth.values()).sqrt()).item()
    worst, name = max((((grads[n] - g).norm() / g.norm()).item(), n) for n, g in truth.items() if g.norm() > 0)
    return whole, worst, name


def test_length_switches_are_as_close_to_fp32_as_plain_checkpointing_at_65536_tokens_each_step():
    spec = SPEC
    plain = cuda_lora_model(spec)
    fp32 = optim.enable(copy.deepcopy(plain).float())  # the same weights, upcast: the truth
    plain = optim.enable(plain)  # the defaults: checkpointing on the GPU, no chunks, nothing offloaded
    long = optim.enable(cuda_lora_model(spec), recompute="all", offload="double", mlp_chunk=4096,
                        attention_split=True, offload_profile=True)
    opt = torch.optim.AdamW([p for p in fp32.parameters() if p.requires_grad], lr=1e-4)
    optim.packing.reset_counters()
    for step in range(2):
        b = make_batch(DataSpec(distribution="fixed", median_doc_len=1 << 20, seed=step), TOKENS, 1,
                       spec.vocab_size).to("cuda")
        assert b.num_docs == 1
        true_loss, truth, _, ms = _step(fp32, b)
        print(f"step {step} fp32: loss {true_loss:.6f}, {ms:.0f} ms", flush=True)
        losses, errors = {}, {}
        for name, model in (("plain", plain), ("long", long)):
            loss, grads, peak, ms = _step(model, b)
            assert set(grads) == set(truth) and len(grads) == 7 * 2 * spec.num_hidden_layers
            losses[name], errors[name] = loss, _error(grads, truth)
            print(f"step {step} {name}: loss {loss:.6f} (fp32 {true_loss:.6f}), LoRA grads from fp32 "
                  f"{errors[name][0]:.4f} together, worst {errors[name][1]:.4f} ({errors[name][2]}), "
                  f"peak above start {peak:.2f} GiB, {ms:.0f} ms", flush=True)
        assert abs(losses["long"] - true_loss) <= 2 * abs(losses["plain"] - true_loss) + 1e-3 * true_loss, (step, losses)
        assert errors["long"][0] <= 2 * errors["plain"][0] + 2e-3, (step, errors)
        assert errors["long"][1] <= 2 * errors["plain"][1] + 5e-3, (step, errors)
        opt.step()  # on the fp32 weights; both bf16 models take them, rounded
        with torch.no_grad():
            for p, q, r in zip(plain.parameters(), long.parameters(), fp32.parameters()):
                p.copy_(r)
                q.copy_(r)
    kernels = optim.packing.kernels()  # the split backward ran, and only on the length switches' side
    # per step and layer: the forward and the recompute
    assert kernels.get("varlen-split", 0) == 2 * 2 * spec.num_hidden_layers, kernels
    assert optim.offload.get(plain) is None  # the reference offloads nothing
    st = optim.offload.get(long).stats()
    # every layer input but the embedding output (a leaf autograd holds) and the last layer's
    n = spec.num_hidden_layers - 2
    assert st["effective_mode"] == "double" and st["offloaded"] == n and st["host_pinned"] is True
    assert st["bytes_offloaded"] == n * TOKENS * spec.hidden_size * 2
    assert len(st["reload_ms"]) == n and len(st["backward_ms"]) == spec.num_hidden_layers
    mlp = optim.enabled(long)["optim.mlp"]
    # per step and layer: the forward, and the recompute, where the MLP's output is unread and skipped
    assert (mlp["chunked_calls"], mlp["recompute_skips"]) == (2 * 2 * spec.num_hidden_layers, 2 * spec.num_hidden_layers)
