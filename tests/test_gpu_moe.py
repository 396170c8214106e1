"""optim.moe on CUDA in bf16, grouped_mm included: matches `loop` within bf16 tolerance, and the
host-sync counts are what the design says (checked with torch's sync debug mode). < 1 min."""

from __future__ import annotations

import copy

import pytest
import torch

import optim.moe as moe
from _moe_common import BACKENDS, MODELS, build, experts_of, rel_err, routings, run_experts, run_model

pytestmark = pytest.mark.gpu

RANK = 8  # bf16: 16-byte rows for grouped_mm
MODES = [(b, lora) for b in BACKENDS for lora in ("merged", "split")]
# bf16 keeps 8 bits of mantissa; merged (W + B·A rounded to bf16) vs split (separate GEMMs) differ
# by a few ulps per element, which sums to ~1e-2 relative error on norms.
TOL = 3e-2


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return build(request.param, "cuda", torch.bfloat16, RANK, gradient_checkpointing=True)


def test_grouped_mm_kernel_available():
    from optim import _moe_ops as ops

    assert ops.grouped_mm_available("cuda"), "torch grouped_mm missing on this GPU"
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 40, 64], device="cuda", dtype=torch.int32)
    ref = torch.cat([x[:10] @ w[0], x[10:40] @ w[2], x[40:] @ w[3]])
    assert rel_err(ops.gmm(x, w, offs), ref) < 1e-2


def test_model_matches_loop_bf16(model):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    moe.enable(model, moe_backend="loop", moe_lora="merged")
    ref_loss, ref_logits, ref_grads = run_model(model, ids, params)
    # The fp32 truth: the same weights in fp32 through the loop. A mode whose error against the
    # bf16 loop is above TOL still passes if it is as close to the truth as the bf16 loop itself
    # (the compiled gate computes in fp32 and rounds once, so it sits on the other side of it).
    twin = copy.deepcopy(model).float()
    moe.enable(twin, moe_backend="loop", moe_lora="merged")
    _, _, true_grads = run_model(twin, ids, {n: p for n, p in twin.named_parameters() if p.requires_grad})
    del twin

    def close(n, got):
        if rel_err(got, ref_grads[n]) < TOL:
            return True
        return rel_err(got.float(), true_grads[n]) <= 1.5 * rel_err(ref_grads[n].float(), true_grads[n]) + 5e-3

    # grouped_mm with moe_compile on (the CUDA default) and off (the eager grouped path)
    for backend, lora, comp in [(b, lo, "auto") for b, lo in MODES[1:]] + [("grouped_mm", "split", False),
                                                                        ("auto", "split", "auto")]:
        moe.enable(model, moe_backend=backend, moe_lora=lora, moe_compile=comp)
        loss, logits, grads = run_model(model, ids, params)
        assert "moe_compile_errors" not in moe.describe(model), moe.describe(model)
        assert abs(loss.item() - ref_loss.item()) < 1e-2 * abs(ref_loss.item()), (backend, lora, comp)
        assert rel_err(logits, ref_logits) < TOL, (backend, lora, comp)
        for n in ref_grads:
            assert close(n, grads[n]), (backend, lora, comp, n, rel_err(grads[n], ref_grads[n]),
                                        rel_err(grads[n].float(), true_grads[n]))
    moe.enable(model)


def test_routing_edge_cases_bf16(model):
    experts = experts_of(model, 0)
    base = experts.get_base_layer()
    E, H, k = base.num_experts, model.config.hidden_size, model.config.num_experts_per_tok
    params = {n: p for n, p in experts.named_parameters() if p.requires_grad}
    for name, idx in routings(10, E, k, "cuda"):
        T = idx.shape[0]
        hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        wts = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
        moe.enable(model, moe_backend="loop", moe_lora="merged")
        ref_out, ref_grads = run_experts(experts, hidden, idx, wts, params)
        for backend, lora in MODES[1:]:
            moe.enable(model, moe_backend=backend, moe_lora=lora)
            out, grads = run_experts(experts, hidden, idx, wts, params)
            assert rel_err(out, ref_out) < TOL, (name, backend, lora)
            for n in ref_grads:
                assert rel_err(grads[n], ref_grads[n]) < TOL, (name, backend, lora, n)
    moe.enable(model)


def test_observed_host_syncs_per_layer(model):
    """CUDA's own sync accounting, one experts layer, forward and backward:
    loop = E (one per torch.where), sorted = 1, grouped_mm = 0."""
    experts = experts_of(model, 0)
    base = experts.get_base_layer()
    E, H, k = base.num_experts, model.config.hidden_size, model.config.num_experts_per_tok
    idx = routings(32, E, k, "cuda")[0][1]
    hidden = torch.randn(32, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wts = torch.rand(32, k, device="cuda", dtype=torch.bfloat16)
    for backend, want, comp in (("loop", E, "auto"), ("sorted", 1, "auto"), ("grouped_mm", 0, False),
                                ("grouped_mm", 0, True)):
        moe.enable(model, moe_backend=backend, moe_lora="split", moe_compile=comp)
        experts(hidden, idx, wts).sum().backward()  # warm-up (lazy init may sync)
        with moe.count_host_syncs("cuda") as s:
            out = experts(hidden, idx, wts)
            out.float().sum().backward()
        assert s.counted == want, (backend, s)
        if backend == "loop":
            # seen on the H100: gpt-oss's loop path syncs once more per layer (E + 1), a
            # constant beside the E routing queries this test is about
            assert want <= s.observed <= want + 1, (backend, s)
        else:
            assert s.observed == want, (backend, s)
    moe.enable(model)
