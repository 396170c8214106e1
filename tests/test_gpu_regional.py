"""optim.regional on CUDA (bf16): compiled decoder layers against eager, with every packed
backend and with stock attention, gradients included. Skipped on CPU by tests/conftest.py."""

from __future__ import annotations

import pytest
import torch
from _lora import randomize_lora_b

import optim.packing as P
import optim.regional as R
from harness.workload import models

pytestmark = pytest.mark.gpu

LENGTHS = [[[37, 150, 13], [200]], [[100, 100], [60, 140]]]


def _build(name, packing_backend, compile_layers, attn="sdpa"):
    # MoE in bf16: rounding differences flip top-k expert choices, which says nothing about
    # compilation (see test_gpu_packing); MoE models are compared in fp32
    dtype = torch.float32 if models.get(name).is_moe else torch.bfloat16
    model = models.build(models.get(name), device="cuda", dtype=dtype, lora_rank=4,
                         attn_implementation=attn)
    randomize_lora_b(model)
    P.enable(model, packing_backend=packing_backend)
    R.enable(model, compile_layers=compile_layers)
    return model


def _run(model, lengths, packed):
    meta = P.PackedMetadata.from_lengths(lengths)
    ids = torch.randint(0, 512, (meta.batch_size, meta.seq_len), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    kw = P.packed_kwargs(meta) if packed else {}
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, position_ids=meta.position_ids().cuda(), **kw).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-6)).item()


CASES = [("qwen3-0.6b-tiny", b, "sdpa") for b in ("sdpa", "flex", "varlen")] + [
    ("gpt-oss-20b-tiny", "flex", "sdpa"),  # sinks and sliding windows through the graph break
    ("qwen3-0.6b-tiny", "off", "sdpa"),  # stock attention traced into the graph
    ("qwen3-0.6b-tiny", "off", "flex_attention"),
]


@pytest.mark.parametrize("name, backend, attn", CASES)
def test_compiled_layers_match_eager_bf16(name, backend, attn):
    if backend == "varlen" and not P.varlen_available():
        pytest.skip("varlen_attn is not available in this torch build")
    eager, comp = _build(name, backend, False, attn), _build(name, backend, True, attn)
    for lengths in LENGTHS:
        (le, ge), (lc, gc) = _run(eager, lengths, backend != "off"), _run(comp, lengths, backend != "off")
        assert abs(lc.item() - le.item()) < 2e-2 * abs(le.item())
        worst = max((_rel(gc[k], ge[k]), k) for k in ge)
        # bf16: both runs round differently (fused vs unfused elementwise); same tolerance as
        # the packing tests' bf16 comparisons
        assert worst[0] < 5e-2, worst
    d = R.describe(comp)
    assert "compile_error" not in d and d["layer_calls"]["eager"] == 0 and d["layer_calls"]["compiled"] > 0
    assert d["flex_traced"] == (backend == "flex")  # flex inside the layer graph, no graph break


def test_auto_runs_causal_sdpa_on_whole_rows_in_compiled_and_eager_layers_bf16():
    """Rows of one document each under auto: compiled layers trace causal SDPA into their graph
    (the stack's pre-hook marks the batch), eager layers call it; a packed batch between two such
    batches runs flex (compiled) or varlen (eager). Each step's loss and gradients stay those of
    flex on the same batch, the first step included."""
    if not P.varlen_available():
        pytest.skip("varlen_attn is not available in this torch build")
    batches = [[[256], [256]], [[100, 156], [256]], [[256], [256]]]
    ref, comp, eager = (_build("qwen3-0.6b-tiny", b, c) for b, c in (("flex", False), ("auto", True), ("auto", False)))
    comp.load_state_dict(ref.state_dict())
    eager.load_state_dict(ref.state_dict())
    P.reset_counters()
    for lengths in batches:
        want = _run(ref, lengths, True)
        for model in (comp, eager):
            loss, grads = _run(model, lengths, True)
            assert abs(loss.item() - want[0].item()) < 2e-2 * abs(want[0].item()), lengths
            worst = max((_rel(grads[k], want[1][k]), k) for k in want[1])
            assert worst[0] < 5e-2, (lengths, worst)
    assert P.counters()["causal_batches"] == 2 and P.counters()["flex_batches"] == 1, P.counters()
    layers = eager.config.num_hidden_layers
    kernels = P.kernels()
    # the eager model, forward and recompute per layer: causal SDPA on the whole rows, varlen on the
    # packed batch; the flex reference ran flex eagerly on all three
    assert kernels["sdpa-causal"] == 2 * 2 * layers and kernels["varlen"] == 2 * layers, kernels
    d = R.describe(comp)
    assert "compile_error" not in d and d["layer_calls"]["eager"] == 0, d
