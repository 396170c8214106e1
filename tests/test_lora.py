"""optim.lora: peft's LoRA Linear as one autograd function in the model's dtype, the same model."""

import pytest
import torch
from _lora import randomize_lora_b
from torch import nn

import optim
from harness.workload import models
from optim import lora


def _batch(spec, seed=0):
    from harness.run.experiment import DataSpec
    from harness.workload.data import make_batch

    return make_batch(DataSpec(median_doc_len=20, seed=seed), 96, 2, spec.vocab_size)


def _build(spec, dtype):
    return randomize_lora_b(models.build(spec, device="cpu", dtype=dtype, lora_rank=4), seed=3)


def _train(model, batches, lr=1e-2, autocast=None):
    """A user's loop with AdamW: per step the loss and every LoRA gradient (fp32 copies); with
    ``autocast`` (a dtype) each forward runs under it, as Trainer's ``bf16=True`` runs it."""
    import contextlib

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            loss = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False).loss
        loss.backward()
        out.append((loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
    return out


def test_fused_is_the_same_math_in_fp32_at_every_step():
    spec = models.get("qwen3-0.6b-tiny")
    batches = [_batch(spec, s) for s in range(3)]
    ref = _train(_build(spec, torch.float32), batches)
    fused = lora.enable(_build(spec, torch.float32))
    assert lora.describe(fused) == {"lora": "fused", "fused_layers": 7 * spec.config().num_hidden_layers}
    got = _train(fused, batches)
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, ref)):
        assert loss == pytest.approx(ref_loss, rel=1e-6), step
        assert set(grads) == set(ref_grads) and any("lora_A" in n for n in grads)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-7, msg=f"step {step} {n}")


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["bf16", "bf16-under-autocast"])
def test_fused_in_bf16_is_as_close_to_fp32_as_peft_is_at_every_step(autocast, monkeypatch):
    """bf16 tolerance, measured: against the same weights run in fp32, the fused layers' loss and
    gradients are no further off than peft's own bf16 run, at each step of a loop. Under autocast
    to bf16 (Trainer's ``bf16=True`` over a bf16 model), which casts only the fp32 adapters, as the
    fused path does itself, the fused path still runs, and is no further off than peft under it."""
    spec = models.get("qwen3-0.6b-tiny")
    batches = [_batch(spec, s) for s in range(3)]
    exact = _build(spec, torch.bfloat16)
    for p in exact.parameters():
        p.data = p.data.float()
    ref = _train(exact, batches, lr=1e-3)
    peft_run = _train(_build(spec, torch.bfloat16), batches, lr=1e-3, autocast=autocast)
    calls = []
    apply = lora._LoraLinear.apply
    monkeypatch.setattr(lora._LoraLinear, "apply", staticmethod(lambda *a: calls.append(1) or apply(*a)))
    model = lora.enable(_build(spec, torch.bfloat16))
    fused_run = _train(model, batches, lr=1e-3, autocast=autocast)
    # every projection at every step, and again in its checkpointed layer's recompute
    assert len(calls) == 3 * 7 * spec.config().num_hidden_layers * (2 if model.is_gradient_checkpointing else 1)

    def err(run, step):
        loss, grads = run[step]
        ref_loss, ref_grads = ref[step]
        assert set(grads) == set(ref_grads)
        return abs(loss - ref_loss), max(((grads[n] - g).abs().max() / g.abs().max()).item()
                                         for n, g in ref_grads.items())

    for step in range(3):
        (peft_loss, peft_grad), (fused_loss, fused_grad) = err(peft_run, step), err(fused_run, step)
        assert fused_loss <= 2 * peft_loss + 1e-3, (step, fused_loss, peft_loss)
        assert fused_grad <= 2 * peft_grad + 1e-3, (step, fused_grad, peft_grad)
        assert peft_grad < 0.05  # the floor itself is bf16's, not a broken reference


def test_under_autocast_to_the_inputs_dtype_the_fused_layer_computes_what_it_does_without():
    """The fused function under autocast to its input's own dtype is the same function: output and
    every gradient equal, to the bit, with autocast on and off."""
    torch.manual_seed(0)
    x = torch.randn(64, 64).to(torch.bfloat16)
    fused = lora.enable(_peft(_Attn().to(torch.bfloat16)))
    off = _outputs(fused, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = _outputs(fused, x)
    assert torch.equal(on[0], off[0]) and on[1].keys() == off[1].keys()
    assert all(torch.equal(on[1][n], off[1][n]) for n in off[1]), [n for n in off[1] if not torch.equal(on[1][n], off[1][n])]


def test_compiled_under_autocast_the_fused_layer_traces_whole_with_the_same_adapter_gradients():
    """As optim.regional compiles a decoder layer under Trainer's autocast: dynamo traces the fused
    function, its backward's autocast shelter included, without a graph break, and the adapters'
    gradients are the eager ones."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    x = torch.randn(64, 64).to(torch.bfloat16)
    model = lora.enable(_peft(_Attn().to(torch.bfloat16)))
    _, eager = _outputs(model, x)
    inner = model.base_model.model
    torch._dynamo.reset()
    counters.clear()
    inner.forward = torch.compile(inner.forward, backend="aot_eager")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, compiled = _outputs(model, x)
    finally:
        del inner.forward
        torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    adapters = [n for n in eager if "lora_" in n]
    assert adapters and all(torch.equal(compiled[n], eager[n]) for n in adapters)


class _Attn(nn.Module):
    """Three projections of one input, as q, k and v are."""

    def __init__(self, d=64):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d, bias=False), nn.Linear(d, 16), nn.Linear(d, 16)

    def forward(self, x):
        return self.q_proj(x).sum() + self.k_proj(x).sum() + self.v_proj(x).sum()


def _peft(module, **kw):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], **kw)
    model = get_peft_model(module, cfg)
    return randomize_lora_b(model, seed=1)


def _saved_bytes(model, x):
    """Bytes autograd keeps for the backward of ``model(x)``, each storage once, parameters not
    counted, by dtype."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, out = set(), {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            out[t.dtype] = out.get(t.dtype, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return out


def test_the_input_is_saved_once_in_the_model_dtype_not_copied_to_fp32_per_projection():
    torch.manual_seed(0)
    x = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
    stock = _peft(_Attn().to(torch.bfloat16))
    peft_saved = _saved_bytes(stock, x)
    # peft: an fp32 copy of x for each of the three projections
    assert peft_saved.get(torch.float32, 0) >= 3 * x.numel() * 4
    fused = _saved_bytes(lora.enable(stock), x)
    assert fused.get(torch.float32, 0) == 0
    # x itself, once for the three projections, and one r-wide x A^T per projection
    assert sum(fused.values()) == x.numel() * 2 + 3 * 512 * 4 * 2


def _outputs(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = model(x)
    y.backward()
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("case", ["dropout", "disabled", "merged", "two_adapters", "dora", "lora_bias", "autocast",
                                  "trained_base", "hooked", "global_hook"])
def test_what_the_fused_path_cannot_compute_runs_peft_forward_bit_for_bit(case):
    torch.manual_seed(0)
    kw = {"dropout": {"lora_dropout": 0.1}, "dora": {"use_dora": True}, "lora_bias": {"lora_bias": True}}.get(case, {})
    x = torch.randn(32, 64)

    def build():
        torch.manual_seed(0)
        model = _peft(_Attn(), **kw)
        if case == "two_adapters":
            from peft import LoraConfig

            model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj"]))
            model.base_model.set_adapter(["default", "second"])
        if case == "merged":
            model.merge_adapter()
        inner = model.base_model.model
        for proj in (inner.q_proj, inner.k_proj, inner.v_proj):
            if case == "trained_base":
                proj.base_layer.weight.requires_grad_(True)
            if case == "hooked":  # as an offloading or sharding wrapper's hook would, it changes the call
                proj.base_layer.register_forward_hook(lambda m, i, o: o * 2)
        return model

    def run(model):
        torch.manual_seed(1)  # dropout's mask
        if case == "disabled":
            with model.disable_adapter():
                return _outputs(model, x)
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return _outputs(model, x)
        if case == "global_hook":
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda m, i, o: o * 2 if type(m) is nn.Linear else o)
            try:
                return _outputs(model, x)
            finally:
                handle.remove()
        return _outputs(model, x)

    ref_y, ref_g = run(build())
    fused = lora.enable(build())
    assert any(type(m) is lora.FusedLoraLinear for m in fused.modules())
    y, g = run(fused)
    assert torch.equal(y, ref_y)
    assert g.keys() == ref_g.keys()
    for n in g:
        assert torch.equal(g[n], ref_g[n]), n


def test_enable_disable_and_the_peft_setting_keep_the_parameters_and_state_dict():
    spec = models.get("qwen3-0.6b-tiny")
    model = _build(spec, torch.float32)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    optim.enable(model, only=("lora",))
    assert sum(type(m) is lora.FusedLoraLinear for m in model.modules()) == 14
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert optim.enabled(model)["optim.lora"]["fused_layers"] == 14
    optim.enable(model, only=("lora",), lora="peft")
    assert not any(type(m) is lora.FusedLoraLinear for m in model.modules())
    assert lora.describe(model) == {"lora": "peft", "fused_layers": 0}
    optim.enable(model, only=("lora",))
    optim.disable(model)
    assert not any(type(m) is lora.FusedLoraLinear for m in model.modules()) and lora.describe(model) == {}
    with pytest.raises(ValueError, match="lora='merged' is not valid"):
        optim.enable(model, lora="merged")


def test_a_model_without_lora_is_left_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    lora.enable(model)
    assert type(model[0]) is nn.Linear and lora.describe(model)["fused_layers"] == 0


def test_the_functions_backward_is_its_forwards_gradient_in_fp64():
    """gradcheck of the autograd function itself (3-D input, bias, scaling): in fp64 the adapters'
    gradients are computed in fp64 too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w, b = torch.randn(4, 6, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64, generator=g)
    a = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bb = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, bb: lora._LoraLinear.apply(x, w, b, a, bb, 1.5), (x, a, bb))


def test_the_fused_layers_trace_whole_under_torch_compile():
    """What optim.regional compiles: the fused forward, its checks and the function, in one graph
    (fullgraph: a graph break raises) holding the fused function once per projection (not peft's
    forward). Traced, the adapter's term is a sum, not eager's in-place addmm (which inductor lowers
    as a copy and an addmm): the forward's only addmms are the two biased base projections, the
    backward has none. Forward and backward equal eager's fused layers within bf16 rounding."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    model = _peft(_Attn().to(torch.bfloat16))
    lora.enable(model)
    ref_y, ref_g = _outputs(model, x)
    graphs, aten = [], []

    def keep(gm, _inputs):
        aten.append(gm)
        return make_boxed_func(gm.forward)

    def recording(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording)
    y, g = _outputs(compiled, x)
    applied = [n for gm in graphs for n in gm.graph.nodes if "autograd_function_apply" in str(n.target)]
    assert len(graphs) == 1 and len(applied) == 3
    addmms = [sum(n.target == torch.ops.aten.addmm.default for n in gm.graph.nodes) for gm in aten]
    assert addmms == [2, 0], addmms  # forward, backward
    assert {n.replace("_orig_mod.", "") for n in g} == set(ref_g)
    pairs = [("y", y, ref_y), *((n, t, ref_g[n.replace("_orig_mod.", "")]) for n, t in g.items())]
    for n, got, ref in pairs:
        # within a bf16 ulp (2^-7 relative) of the largest value: the sum rounds the adapter's term once more
        assert (got.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max(), n
