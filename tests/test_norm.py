"""optim.norm: the decoder stack's final RMSNorm in token chunks. Its output is the stock norm's to
the bit; its gradients are autograd's through the stock norm within rounding; a norm of another
form keeps its own forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim
import optim.norm as N
from harness.workload import models


def _stock_and_chunked(norm_cls, hidden, dtype, tokens, chunk, weight_grad=False):
    torch.manual_seed(0)
    m = norm_cls(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(hidden))
    m.weight.requires_grad_(weight_grad)
    x = (3 * torch.randn(2, tokens, hidden)).to(dtype).requires_grad_()
    g = torch.randn(2, tokens, hidden).to(dtype)
    out = {}
    for name in ("stock", "chunked"):
        if name == "chunked":
            form = N._form(m)
            assert form is not None
            m.__class__ = N._chunked_class(type(m))
            m._optim_norm_chunk, m._optim_norm_form = chunk, form
        m.weight.grad = None
        y = m(x)
        gx, = torch.autograd.grad(y, x, g, retain_graph=weight_grad)
        gw = torch.autograd.grad(y, m.weight, g)[0] if weight_grad else None
        out[name] = (y.detach(), gx, gw)
    assert vars(m).get("_optim_norm_calls") == 1
    return out


def _norm_classes():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return {"llama": LlamaRMSNorm, "qwen3": Qwen3RMSNorm, "gpt-oss": GptOssRMSNorm}


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt-oss"])
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_output_is_the_stock_norms_to_the_bit_and_gradients_agree(kind, dtype, rtol):
    out = _stock_and_chunked(_norm_classes()[kind], 64, dtype, tokens=37, chunk=8, weight_grad=True)
    (y0, gx0, gw0), (y1, gx1, gw1) = out["stock"], out["chunked"]
    assert y0.dtype == y1.dtype and torch.equal(y0, y1)
    for a, b in ((gx0, gx1), (gw0, gw1)):
        err = ((a.float() - b.float()).norm() / a.float().norm()).item()
        assert err < rtol, err


def test_the_forms_are_told_apart_and_another_norm_keeps_its_forward():
    classes = _norm_classes()
    # in bf16, where the forms differ (in fp32 they compute the same)
    assert N._form(classes["llama"](16).to(torch.bfloat16)) == "weight_after_cast"
    assert N._form(classes["qwen3"](16).to(torch.bfloat16)) == "weight_after_cast"
    assert N._form(classes["gpt-oss"](16).to(torch.bfloat16)) == "weight_before_cast"

    class OtherEps(nn.Module):  # an eps other than the one it names: in bf16 only small inputs tell
        def __init__(self, n):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(n, dtype=torch.bfloat16)), 1e-6

        def forward(self, x):
            x32 = x.float()
            return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    assert N._form(OtherEps(16)) is None

    class OnePlus(nn.Module):  # Gemma's form: (1 + weight)
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.randn(n)), 1e-6

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).to(x.dtype)

    assert N._form(OnePlus(16)) is None
    with_bias = classes["llama"](16)
    with_bias.bias = nn.Parameter(torch.zeros(16))
    assert N._form(with_bias) is None


def test_an_input_of_another_dtype_than_the_weight_runs_the_norms_own_forward():
    """A norm kept in fp32 (gpt-oss keeps its norms so in fp16 models) under bf16 activations: the
    stock forward gives its own dtype and values, and the function is not called."""
    m = _norm_classes()["gpt-oss"](32)  # fp32 weight
    assert N._form(m) == "weight_after_cast"  # in fp32 the forms agree: the probe cannot tell them
    m.__class__ = N._chunked_class(type(m))
    m._optim_norm_chunk, m._optim_norm_form = 8, N._form(m)
    x = torch.randn(1, 40, 32).to(torch.bfloat16).requires_grad_()
    y = m(x)
    assert vars(m).get("_optim_norm_calls") is None
    assert torch.equal(y, N._chunked_class(type(m)).__mro__[1].forward(m, x))


def test_under_autocast_to_the_inputs_dtype_the_chunked_norm_runs_and_matches_the_stock_one():
    """Trainer's bf16=True over a bf16 model: the function runs under that autocast, and its output
    is the stock norm's under it, to the bit."""
    m = _norm_classes()["qwen3"](32).to(torch.bfloat16)
    stock = type(m).forward
    m.__class__ = N._chunked_class(type(m))
    m._optim_norm_chunk, m._optim_norm_form = 8, N._form(m)
    x = torch.randn(1, 40, 32).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = m(x), stock(m, x)
    assert vars(m)["_optim_norm_calls"] == 1 and y.dtype == want.dtype and torch.equal(y, want)
    with torch.autocast("cpu", dtype=torch.float16):  # another dtype than the input's: its own forward
        m(x)
    assert vars(m)["_optim_norm_calls"] == 1


def test_short_inputs_no_grad_and_extra_arguments_run_the_norms_own_forward():
    m = _norm_classes()["llama"](32)
    m.__class__ = N._chunked_class(type(m))
    m._optim_norm_chunk, m._optim_norm_form = 8, "weight_after_cast"
    x = torch.randn(1, 8, 32, requires_grad=True)
    m(x)  # 8 tokens: not more than a chunk
    with torch.no_grad():
        m(torch.randn(1, 64, 32))
    assert vars(m).get("_optim_norm_calls") is None
    m(torch.randn(1, 9, 32, requires_grad=True))
    assert vars(m)["_optim_norm_calls"] == 1


def test_enable_chunks_the_final_norm_only_and_the_model_trains_as_stock():
    spec = models.get("qwen3-0.6b-tiny")
    torch.manual_seed(0)
    stock = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2)
    chunked = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2)
    chunked.load_state_dict(stock.state_dict())
    ids = torch.randint(0, spec.vocab_size, (1, 40))
    optim.enable(chunked, only=("norm",), norm_chunk=1024)  # 40 tokens: no chunking yet
    assert optim.enabled(chunked)["optim.norm"]["chunked_norms"] == 1
    for m in N.final_norms(chunked):
        m._optim_norm_chunk = 16  # as if the switch allowed it: chunks of 16 over 40 tokens
    norms = [m for m in chunked.modules() if type(m).__name__.endswith("RMSNorm")]
    assert sum(type(m).__name__.startswith("Chunked") for m in norms) == 1  # the layers' own are left alone
    losses, grads = [], []
    for model in (stock, chunked):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6), n
    assert optim.enabled(chunked)["optim.norm"]["chunked_calls"] == 1
    optim.disable(chunked)
    assert not any(type(m).__name__.startswith("Chunked") for m in chunked.modules())


def test_off_by_default_and_from_the_environment(monkeypatch):
    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)
    optim.enable(model, only=("norm",))
    assert optim.enabled(model)["optim.norm"]["chunked_norms"] == 0
    monkeypatch.setenv("OPTIM_NORM_CHUNK", "4096")
    optim.enable(model, only=("norm",))
    assert optim.enabled(model)["optim.norm"]["resolved"] == {"norm_chunk": 4096}
    with pytest.raises(ValueError, match="norm_chunk"):
        optim.enable(model, norm_chunk=100)
