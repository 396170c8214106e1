"""The decoder stack's final RMSNorm in token chunks (switch ``norm_chunk``).

Inside the decoder layers ``optim.regional`` compiles each RMSNorm into the layer's graph, and a
checkpointed layer keeps nothing of it. The stack's final norm, between the last layer and the LM
head, runs eager outside both, as transformers writes it: the input cast to fp32, its mean square,
the product with the reciprocal root, the weight. Autograd keeps that fp32 copy of the input for
the backward, and the backward makes the fp32 gradient of each of those steps over every token at
once. At long context that is the step's largest block: one hidden-size fp32 tensor kept from the
forward to the backward, and several at once in the backward, when the loss's gradient arrives.

``norm_chunk=N`` runs that norm as one autograd function. Its forward computes N tokens at a time,
with the same operations per token (the output is the stock norm's, to the bit), and keeps the
input and one fp32 value a token, the reciprocal root. Its backward computes the input's gradient
N tokens at a time from those, in fp32, as autograd's chain through the same steps does. It is off
by default until measured on a GPU.

Which norm: a module named ``norm`` beside a ``layers`` ModuleList (Llama, Qwen, Mistral, gpt-oss
decoder stacks). Which math: at ``enable``, the norm's own forward is run on a few random tokens
and compared with the two forms the function computes, ``weight * x̂.to(dtype)`` (Llama, Qwen) and
``(weight * x̂).to(dtype)`` (gpt-oss); a norm that matches neither to the bit (Gemma's ``1 +
weight``, a norm with a bias) keeps its own forward. Without grad, under autocast to another
dtype than the input's, for an input of another dtype than the weight's (a norm kept in fp32) and for inputs of at most N tokens, the
norm runs its own forward. The function runs outside ``torch.compile``: a compiled whole model
breaks its graph there.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from optim._autocast import changes as autocast_changes
from optim._hf import owner
from optim.switches import switches_of

SWITCHES = switches_of(__name__)

_STATE = "_optim_norm"
_FORMS = ("weight_after_cast", "weight_before_cast")
_CLASSES: dict[type, type] = {}


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm of ``x`` (tokens, hidden) as transformers computes it, and its fp32 reciprocal root."""
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x32 * r
    out = weight * xhat.to(x.dtype) if form == _FORMS[0] else (weight * xhat).to(x.dtype)
    return out, r


class _ChunkedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, chunk, form):
        x2 = x.reshape(-1, x.shape[-1])
        out = None  # in the dtype the norm's own forward gives (the weight's and x's promoted, or x's)
        r = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        for a in range(0, x2.shape[0], chunk):
            o, r[a:a + chunk] = _normed(x2[a:a + chunk], weight, eps, form)
            if out is None:
                out = torch.empty(x2.shape, dtype=o.dtype, device=x.device)
            out[a:a + chunk] = o
        ctx.save_for_backward(x, weight, r)
        ctx.chunk, ctx.form = chunk, form
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, weight, r = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        dx = torch.empty_like(x2)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for a in range(0, x2.shape[0], ctx.chunk):
            gc, rc = g2[a:a + ctx.chunk], r[a:a + ctx.chunk]
            xhat = x2[a:a + ctx.chunk].to(torch.float32) * rc
            if ctx.form == _FORMS[0]:  # weight * x̂.to(dtype): the product in x's dtype, then the cast back
                gx = (gc * weight).to(x.dtype).to(torch.float32)
                if dw is not None:
                    dw += (gc * xhat.to(x.dtype)).to(torch.float32).sum(0)
            else:  # (weight * x̂).to(dtype): the product in fp32
                gx = gc.to(torch.float32) * weight.to(torch.float32)
                if dw is not None:
                    dw += (gc.to(torch.float32) * xhat).sum(0)
            # d/dx of x * r(x), r = (mean(x²) + eps)^-1/2: r * (gx - x̂ * mean(gx * x̂))
            dx[a:a + ctx.chunk] = (rc * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx.view(x.shape), None if dw is None else dw.to(weight.dtype), None, None, None


def _eps(m: nn.Module) -> float | None:
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _form(m: nn.Module) -> str | None:
    """Which of ``_FORMS`` the norm's own forward computes, to the bit on a few random tokens in its
    weight's dtype and device (of unit and of small magnitude, where eps counts), with a random
    weight of its own; None for neither, or a norm this cannot read or copy."""
    w, eps = getattr(m, "weight", None), _eps(m)
    params = list(m.parameters())
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.is_meta or eps is None or len(params) != 1 \
            or params[0] is not w:
        return None
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(8, w.shape[0], generator=gen, device=w.device)
    x = torch.cat([x[:4], 1e-3 * x[4:]]).to(w.dtype)
    try:
        probe = copy.deepcopy(m)  # a weight of its own, random: with ones (a fresh norm's) the forms agree
        with torch.no_grad():
            probe.weight.copy_(1 + torch.randn(w.shape, generator=gen, device=w.device))
            want = type(m).forward(probe, x)
            for form in _FORMS:
                got, _ = _normed(x, probe.weight, eps, form)
                if got.dtype == want.dtype and torch.equal(got, want):
                    return form
    except Exception:  # a norm that cannot be copied or run apart (a sharded weight): keep its forward
        return None
    return None


@torch.compiler.disable
def _chunked_forward(self, x, *args, **kwargs):
    chunk, form = vars(self).get("_optim_norm_chunk"), vars(self).get("_optim_norm_form")
    tokens = x.numel() // max(1, x.shape[-1])
    if args or kwargs or not (torch.is_grad_enabled() and x.requires_grad) or tokens <= chunk \
            or x.dtype != self.weight.dtype or autocast_changes(x.device.type, x.dtype):
        return super(type(self), self).forward(x, *args, **kwargs)
    vars(self)["_optim_norm_calls"] = vars(self).get("_optim_norm_calls", 0) + 1
    return _ChunkedRMSNorm.apply(x, self.weight, _eps(self), chunk, form)


def _chunked_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Chunked{cls.__name__}", (cls,), {"forward": _chunked_forward, "_optim_norm_base": cls})
    return _CLASSES[cls]


def final_norms(model: nn.Module) -> list[nn.Module]:
    """Each decoder stack's final norm: a module ``norm`` beside a ``layers`` ModuleList."""
    return [m._modules["norm"] for m in model.modules()
            if isinstance(m._modules.get("layers"), nn.ModuleList) and isinstance(m._modules.get("norm"), nn.Module)]


def enable(model: nn.Module, **settings: Any) -> nn.Module:
    """Apply ``norm_chunk`` to each decoder stack's final RMSNorm; returns the model. Parameters and
    state-dict keys are unchanged."""
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise TypeError(f"unknown optim.norm settings: {sorted(unknown)} (valid: {sorted(SWITCHES)})")
    chunk = SWITCHES["norm_chunk"].resolve(settings.get("norm_chunk"))
    disable(model)
    chunked, kept = 0, []
    for m in final_norms(model) if chunk != "off" else []:
        form = _form(m)
        if form is None:
            kept.append(type(m).__name__)
            continue
        m.__class__ = _chunked_class(type(m))
        m._optim_norm_chunk, m._optim_norm_form = chunk, form
        chunked += 1
    vars(owner(model))[_STATE] = {"norm_chunk": chunk, "chunked_norms": chunked, "kept_norms": kept}
    return model


def disable(model: nn.Module) -> nn.Module:
    for m in model.modules():
        base = vars(type(m)).get("_optim_norm_base")
        if base is not None:
            m.__class__ = base
            for key in ("_optim_norm_chunk", "_optim_norm_form", "_optim_norm_calls"):
                vars(m).pop(key, None)
    vars(owner(model)).pop(_STATE, None)
    return model


def run_stats(model: nn.Module) -> dict[str, Any]:
    """How many final-norm calls ran in chunks in the steps so far, for a results row."""
    return {"norm_stats": describe(model) or None}


def describe(model: nn.Module) -> dict[str, Any]:
    """What enable() did, and how many norm calls ran chunked since (empty when not applied)."""
    state = vars(owner(model)).get(_STATE)
    if state is None:
        return {}
    return {**state, "chunked_calls": sum(vars(m).get("_optim_norm_calls", 0) for m in model.modules())}
