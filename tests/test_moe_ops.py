"""optim._moe_ops on CPU: what the grouped path's routing and LoRA layout cost per step, by the
ATen ops they dispatch, and that the cheaper forms give the reference's values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optim import _moe_compiled as compiled
from optim import _moe_ops as ops

COPIES = ("aten._to_copy", "aten.copy_", "aten.clone", "aten._unsafe_view")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def count(self, *names: str) -> int:
        return sum(self.names.count(n) for n in names)


def _peft_factors(E=4, r=8, d_in=32, d_out=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    wa = torch.randn(E * r, d_in, generator=g, requires_grad=True)  # peft: (E·r, in), expert-major
    wb = torch.randn(d_out, r * E, generator=g, requires_grad=True)  # (out, r·E), expert-minor
    return wa, wb


def _reference_factors(wa, wb, E, dtype):
    a_t = wa.reshape(E, -1, wa.shape[-1]).transpose(1, 2)
    b_t = wb.reshape(wb.shape[0], -1, E).permute(2, 1, 0)
    return a_t.to(dtype).contiguous(), b_t.to(dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_factors_cost_one_kernel_each_way_and_match_the_reference(dtype):
    """peft's fp32 expert LoRA to the bf16 factors the GEMMs read: A is a transposed view of one
    cast, B one cast-and-relayout, and each gradient comes back with one kernel. Laying them out
    as cast + ``.contiguous()`` cost eight copies per projection per step."""
    E = 4
    wa, wb = _peft_factors(E)
    ga = torch.randn(E, 8, 32, dtype=dtype).transpose(1, 2)  # grouped_mm: the layout of A_t
    gb = torch.randn(E, 8, 48, dtype=dtype)
    with _Ops() as fwd:
        a_t, b_t = ops.raw_to_factors(wa, wb, E, dtype)
    with _Ops() as bwd:
        da, db = torch.autograd.grad([a_t, b_t], [wa, wb], [ga, gb])
    want = 0 if dtype == torch.float32 else 1  # fp32: A is a view of peft's own weight
    assert fwd.count(*COPIES) == want + 1, fwd.names
    assert bwd.count(*COPIES) == want + 1, bwd.names

    wa2, wb2 = (w.detach().clone().requires_grad_() for w in (wa, wb))
    ra, rb = _reference_factors(wa2, wb2, E, dtype)
    rda, rdb = torch.autograd.grad([ra, rb], [wa2, wb2], [ga, gb])
    torch.testing.assert_close(a_t, ra, rtol=0, atol=0)
    torch.testing.assert_close(b_t, rb, rtol=0, atol=0)
    torch.testing.assert_close(da, rda, rtol=0, atol=0)
    torch.testing.assert_close(db, rdb, rtol=0, atol=0)
    assert da.shape == wa.shape and db.shape == wb.shape and db.is_contiguous()


def test_compile_factors_pad_a_rank_grouped_mm_cannot_read():
    """Rank 4 in bf16 leaves 8-byte rows: the compiled path gets A contiguous and both padded to
    rank 8 (zero columns: X·A·B unchanged); rank 8 keeps A a view."""
    for r, padded in ((4, True), (8, False)):
        wa, wb = _peft_factors(r=r)
        a_t, b_t = compiled.compile_factors(wa, wb, 4, torch.bfloat16)
        assert a_t.shape[-1] == b_t.shape[1] == 8
        assert a_t.is_contiguous() == padded
        assert ops.aligned(a_t) and ops.aligned(b_t)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_routing_gathers_backward_scatters_without_index_add(top_k):
    """The gradient of the routed rows goes back to the tokens as the combine does (one scatter to
    pair order, a sum over the k slots): no ``index_add``, whose bf16 atomics are slow on a GPU
    and sum in a varying order. Same gradients as index_select's."""
    T, H, E = 10, 16, 4
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(T, E, generator=g)
    idx = logits.topk(top_k, dim=-1).indices
    wts = torch.softmax(logits.gather(1, idx), -1).requires_grad_()
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    grouping = ops.Grouping(idx, E)
    x, w = grouping.gather(hidden, wts)
    gx, gw = torch.randn(x.shape, generator=g, dtype=x.dtype), torch.randn(w.shape, generator=g, dtype=w.dtype)
    with _Ops() as bwd:
        dh, dw = torch.autograd.grad([x, w], [hidden, wts], [gx, gw])
    assert bwd.count("aten.index_add", "aten.index_add_") == 0, bwd.names

    token = grouping.perm // top_k
    torch.testing.assert_close(x, hidden.index_select(0, token))
    torch.testing.assert_close(w, wts.reshape(-1).index_select(0, grouping.perm))
    h2, w2 = hidden.detach().requires_grad_(), wts.detach().requires_grad_()
    rdh, rdw = torch.autograd.grad([h2.index_select(0, token), w2.reshape(-1).index_select(0, grouping.perm)],
                                   [h2, w2], [gx, gw])
    torch.testing.assert_close(dh, rdh)
    torch.testing.assert_close(dw, rdw)


@pytest.mark.parametrize("shape,strides,dtype,ok", [
    ((64, 32), (32, 1), torch.bfloat16, True),      # row-major, 64-byte rows
    ((8, 32, 16), (512, 1, 32), torch.bfloat16, True),  # column-major per expert (A_t as a view of lora_A)
    ((1, 36), (36, 1), torch.bfloat16, False),      # one routed row: its 72-byte stride still counts
    ((5, 1), (1, 1), torch.float32, False),         # a rank-1 intermediate: 4-byte rows
    ((96, 4), (4, 1), torch.bfloat16, False),       # rank 4 in bf16: 8-byte rows
    ((4, 8), (16, 2), torch.float32, False),        # neither layout (every other column)
])
def test_aligned_follows_grouped_mms_stride_contract(shape, strides, dtype, ok):
    t = torch.empty_strided(shape, strides, dtype=dtype).copy_(torch.randn(shape))
    assert ops.aligned(t) is ok
    if len(shape) == 2:  # as gmm's input: the kernel where it says yes, the per-expert fallback where no
        w = torch.randn(2, shape[-1], 8, dtype=dtype)
        half = shape[0] // 2
        offs = torch.tensor([half, shape[0]], dtype=torch.int32)
        torch.testing.assert_close(ops.gmm(t, w, offs), torch.cat([t[:half] @ w[0], t[half:] @ w[1]]))


def test_no_routed_tokens_give_an_empty_output_and_backward():
    """A batch with no tokens: every backend returns (0, hidden) and back-propagates to the hidden
    states and the routing weights (the loop's zero buffer alone is not in the graph)."""
    from types import SimpleNamespace

    E, H, I = 4, 16, 8
    g = torch.Generator().manual_seed(0)
    mod = SimpleNamespace(num_experts=E, is_transposed=True, has_bias=False,
                          gate_up_proj=torch.randn(E, H, 2 * I, generator=g),
                          down_proj=torch.randn(E, I, H, generator=g),
                          _apply_gate=lambda h: h[..., ::2] * torch.sigmoid(h[..., 1::2]))
    wa, wb = _peft_factors(E, d_in=H, d_out=2 * I)
    for backend in ("grouped_mm", "sorted", "loop"):
        hidden = torch.randn(0, H, requires_grad=True)
        wts = torch.rand(0, 2, requires_grad=True)
        lora = {"gate_up_proj": [(*ops.raw_to_factors(wa, wb, E, torch.float32), 1.0)]}
        out = ops.BACKENDS[backend](mod, hidden, torch.zeros(0, 2, dtype=torch.long), wts, lora)
        assert out.shape == (0, H), backend
        out.sum().backward()
        assert hidden.grad.shape == (0, H) and wts.grad.shape == (0, 2)
