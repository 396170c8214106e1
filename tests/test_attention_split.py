"""attention_split: FlashAttention's backward a group of query heads at a time (optim.packing.backends).

The kernel is CUDA-only; here its arithmetic runs on the reference flash implementation the sink
tests use, so what is checked is the split itself: which heads each call gets, how the calls'
gradients are put back together, and when the switch splits. tests/test_gpu_packing.py checks the
real kernel's gradients and memory."""

from __future__ import annotations

import pytest
import torch

import optim.packing as P
from optim.packing import backends as PB
from test_packing import _ref_flash_backward, _ref_flash_forward


@pytest.mark.parametrize("heads, kv_heads, want", [
    (32, 8, 4),    # Llama-3.1-8B, Qwen3-8B: one KV group a call, eight calls
    (64, 8, 8),    # gpt-oss-20b
    (32, 32, 4),   # no grouping: four heads a call
    (32, 1, 4),    # one KV head: its gradient summed over eight calls
    (12, 4, 1),    # groups of 3 over 12 heads: 12 // 8 = 1 head a call
    (4, 2, 1),
    (16, 2, 2),    # groups of 8: two heads a call, four calls per KV head
])
def test_split_width_covers_whole_groups_or_a_whole_part_of_one(heads, kv_heads, want):
    w = PB.split_width(heads, kv_heads)
    group = heads // kv_heads
    assert w == want
    assert heads % w == 0 and (w % group == 0 or group % w == 0)
    assert heads // w >= min(PB.SPLIT_CALLS, heads)  # calls enough that one group's buffers are small


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 8), (16, 1), (24, 3)])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_split_backward_gives_the_whole_backward_gradients(monkeypatch, heads, kv_heads, sinks, window):
    monkeypatch.setitem(PB._flash_ops, "forward", _ref_flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",
                        type("S", (), {"default": type("D", (), {"_schema": "window_size_left"})()})(),
                        raising=False)  # the reference takes a window: tell _window_kw the kernel does
    calls = []

    def counted(*a, **k):
        calls.append(a[1].shape[1])  # query heads of this call
        return _ref_flash_backward(*a, **k)

    monkeypatch.setitem(PB._flash_ops, "backward", counted)
    monkeypatch.setattr(PB, "SPLIT_CALLS", 4)
    torch.manual_seed(heads + kv_heads)
    T, D = 19, 8
    q = torch.randn(T, heads, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, kv_heads, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, kv_heads, D, dtype=torch.float64, requires_grad=True)
    s = torch.randn(heads, dtype=torch.float64, requires_grad=True) if sinks else None
    cu = torch.tensor([0, 6, 19], dtype=torch.int32)
    w = torch.randn(T, heads, D, dtype=torch.float64)
    inputs = (q, k, v) + ((s,) if sinks else ())
    grads = {}
    for split in (False, True):
        calls.clear()
        out = PB._FlashVarlen.apply(q, k, v, s, cu, 13, 0.3, -1 if window is None else window - 1, split)
        grads[split] = torch.autograd.grad((out * w).sum(), inputs)
        n = len(calls)
        assert n == (heads // PB.split_width(heads, kv_heads) if split else 1)
        assert sum(calls) == heads
    assert PB.split_width(heads, kv_heads) < heads  # each case does split
    for whole, parts in zip(grads[False], grads[True]):
        assert torch.allclose(whole, parts, rtol=0, atol=1e-12), (whole - parts).abs().max()


def test_split_applies_where_it_is_on_and_the_flash_kernel_runs(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(PB, "varlen_available", lambda: True)
    assert PB.split_applies(True, cuda, torch.bfloat16) and PB.split_applies(True, cuda, torch.float16)
    assert not PB.split_applies(False, cuda, torch.bfloat16)
    assert not PB.split_applies(True, cuda, torch.float32)  # flash is fp16/bf16 only
    assert not PB.split_applies(True, cpu, torch.bfloat16)
    monkeypatch.setattr(PB, "varlen_available", lambda: False)
    assert not PB.split_applies(True, cuda, torch.bfloat16)


def test_the_switch_reaches_every_attention_module_and_describe(monkeypatch):
    from harness.workload import models

    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)
    P.enable(model)
    assert P.describe(model)["attention_split"] is False  # off by default
    P.enable(model, attention_split=True)
    assert all(m._optim_packing.split is True for m in P._attention_modules(model))
    P.enable(model, attention_split=False)
    assert all(m._optim_packing.split is False for m in P._attention_modules(model))
    monkeypatch.setenv("OPTIM_ATTENTION_SPLIT", "on")
    P.enable(model)
    assert P.describe(model)["attention_split"] is True
    with pytest.raises(ValueError, match="attention_split"):
        P.enable(model, attention_split="sometimes")
    P.disable(model)


def test_a_one_document_row_runs_the_split_varlen_kernel_where_the_switch_is_on(monkeypatch):
    """Routing: with the switch on, the row of one document that ``auto`` gives causal SDPA goes
    through the varlen kernel with split=True (stubbed here: the kernel is CUDA-only; the split's
    arithmetic is checked above on the reference kernel), and with it off never does."""
    seen = []
    monkeypatch.setattr(P, "split_applies", lambda choice, device, dtype: choice is True)
    monkeypatch.setitem(P.KERNELS, "varlen", lambda *a, split=False: seen.append(split) or PB.sdpa_causal(*a[1:4], a[4]))
    from harness.workload import models

    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)
    ids = torch.randint(0, 100, (1, 24))
    meta = P.PackedMetadata.from_lengths([[24]])
    P.enable(model, attention_split=False)
    ref = model(input_ids=ids, **P.packed_kwargs(meta)).logits
    assert seen == []
    P.enable(model, attention_split=True)
    got = model(input_ids=ids, **P.packed_kwargs(meta)).logits
    assert seen and all(seen)
    assert torch.allclose(ref, got, atol=1e-5)
    P.disable(model)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 8), (16, 1), (24, 3)])
def test_causal_sdpa_split_by_heads_is_causal_sdpa(heads, kv_heads, monkeypatch):
    """sdpa_causal_split: the output and the q, k, v gradients of sdpa_causal, one group of heads a
    call (on the CPU's math kernel; harness.bench.attention measures it on CUDA)."""
    monkeypatch.setattr(PB, "SPLIT_CALLS", 4)
    torch.manual_seed(heads)
    T, D = 23, 8
    q = torch.randn(2, heads, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, T, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, T, heads, D, dtype=torch.float64)
    whole, split = PB.sdpa_causal(q, k, v, 0.3), PB.sdpa_causal_split(q, k, v, 0.3)
    assert split.shape == whole.shape == (2, T, heads, D) and torch.allclose(whole, split, atol=1e-12)
    for a, b in zip(torch.autograd.grad((whole * w).sum(), (q, k, v)), torch.autograd.grad((split * w).sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-12)
