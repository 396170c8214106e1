"""peft's LoRA linear layers as one autograd function in the model's dtype (switch ``lora``).

peft keeps LoRA adapters in fp32 by default (``autocast_adapter_dtype``) and casts each layer's
input to fp32 before ``lora_A``. Autograd keeps that copy for ``lora_A``'s gradient: one T x in
fp32 tensor per projection, q, k and v each their own. At 8192 tokens on a Qwen3-8B layer that is
q, k, v, o, gate and up at 128 MiB each and down at 384 MiB, 1.1 GiB a layer, the size of the
layer's own bf16 activations. The adapter's fp32 output also promotes each projection's sum to
fp32 before the cast back, which is more memory traffic.

``lora="fused"`` (the default) gives each plain peft ``lora.Linear`` one autograd function:
``y = x W^T + b + s (x A^T) B^T``, with A and B cast to the input's dtype for the matmuls. The fp32
master weights and their optimizer states are unchanged. Only ``x`` is saved, as the tensor the
layer was given, so projections that share an input (q, k, v; gate, up) share one saved tensor.
The r-wide ``x A^T`` is saved too. The backward computes
``dx = g W + s (g B) A`` and the adapters' gradients ``dA = s (g B)^T x`` and ``dB = s g^T (x A^T)``.
On CUDA these accumulate in fp32 and are written in fp32; elsewhere they are computed in fp32 from
the saved tensors. Unsloth's LoRA kernels take the same approach.

A layer runs peft's own forward when the fused path would not give the same model: adapters
disabled or merged, several adapters active or a mixed batch (``adapter_names``), a LoRA variant
(DoRA and others), dropout, a LoRA bias, ``fan_in_fan_out``, a trained base weight, autocast to
another dtype than the input's (autocast to its own dtype, Trainer's ``bf16=True`` over a bf16
model, casts the adapters as the fused path does), or an input of another dtype than the base
weight's. It does so too where calling the base layer or
the adapters would run hooks that reading their weights skips, or where a weight is not a plain
local matrix: accelerate's offloading, DeepSpeed ZeRO-3, FSDP wrapping the adapters, a user's
hooks. ``lora="peft"`` leaves every layer as peft
built it. Only torch and peft are imported here; without peft there is nothing to fuse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from optim._autocast import changes as autocast_changes
from optim._autocast import off as autocast_off
from optim._hf import owner
from optim.switches import switches_of

SWITCHES = switches_of(__name__)

try:  # peft is optional: without it there are no LoRA layers
    from peft.tuners.lora.layer import Linear as PeftLinear
except ImportError:  # pragma: no cover - peft is a dependency of every install
    PeftLinear = None

_STATE = "_optim_lora"


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b written in fp32 at least: for fp16/bf16 inputs on CUDA one cuBLAS call accumulating
    in fp32 (no rounding to the inputs' dtype), elsewhere the product of fp32 copies; fp32 and
    fp64 inputs in their own dtype."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks that reading its weights directly skips (an
    offloading, gathering or sharding wrapper's, or a user's)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def _plain(w: torch.Tensor) -> bool:
    """A weight the matmuls can read as it is: a local 2-D parameter or tensor, not a shard or a
    placeholder (FSDP's DTensor, DeepSpeed ZeRO-3's emptied partition, an offloaded empty one)."""
    return (type(w) is nn.Parameter or type(w) is torch.Tensor) and w.dim() == 2 and w.numel() > 0


def lora_forward(x2: torch.Tensor, weight, bias, lora_a, lora_b, scaling: float):
    """``(x2 W^T + b + s (x2 A^T) B^T, x2 A^T)`` for 2-D ``x2``, in its dtype: the output and the
    r-wide product the adapters' gradients need."""
    xa = x2 @ lora_a.to(x2.dtype).t()
    y = torch.nn.functional.linear(x2, weight, bias)
    return _add_product(y, xa, lora_b.to(x2.dtype).t(), scaling), xa


def _add_product(y: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, alpha: float) -> torch.Tensor:
    """``y + alpha (m1 @ m2)``. Eager: in place into ``y``, one T x out buffer, not two. Traced by
    torch.compile: as a sum, because inductor lowers an in-place addmm on a fresh buffer as a copy
    of it followed by the addmm (a device-to-device copy and a launch per call), where the sum fuses
    into the pointwise kernel that reads ``y`` next (the norm, the activation, the residual)."""
    if torch.compiler.is_compiling():
        return y + (m1 @ m2) * alpha
    return y.addmm_(m1, m2, alpha=alpha)


def lora_backward(g, x2, xa, weight, lora_a, lora_b, scaling: float, want_x=True, want_a=True, want_b=True):
    """The gradients of ``lora_forward``'s output ``g`` (2-D) reaching x2, A and B (each None where
    not wanted): ``dx = g W + s (g B) A``, ``dA = s (g B)^T x2``, ``dB = s g^T (x2 A^T)``, the
    adapters' in fp32 (see ``_mm_f32``) and then in their own dtype."""
    a, b = lora_a.to(g.dtype), lora_b.to(g.dtype)
    gb = g @ b  # (T, r): the gradient reaching x A^T, before the scaling
    grad_x = _add_product(g @ weight, gb, a, scaling) if want_x else None
    grad_a = _mm_f32(gb.t(), x2).mul_(scaling).to(lora_a.dtype) if want_a else None
    grad_b = _mm_f32(g.t(), xa).mul_(scaling).to(lora_b.dtype) if want_b else None
    return grad_x, grad_a, grad_b


class _LoraLinear(torch.autograd.Function):
    """x W^T + b + s (x A^T) B^T over the last dimension of x, W and b frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        y, xa = lora_forward(x.reshape(-1, x.shape[-1]), weight, bias, lora_a, lora_b, scaling)
        ctx.save_for_backward(x, xa, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x, xa, weight, lora_a, lora_b = ctx.saved_tensors
        need = ctx.needs_input_grad
        with autocast_off(grad_y.device.type):
            grad_x, grad_a, grad_b = lora_backward(
                grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1]), xa, weight, lora_a, lora_b,
                ctx.scaling, need[0], need[3], need[4])
        return None if grad_x is None else grad_x.reshape(x.shape), None, None, grad_a, grad_b, None


def fusable(layer) -> bool:
    """What can be decided once, at enable: peft's plain Linear over a plain nn.Linear, weights
    as rows (no fan_in_fan_out)."""
    return (PeftLinear is not None and type(layer) in (PeftLinear, FusedLoraLinear)
            and type(layer.get_base_layer()) is nn.Linear and not layer.fan_in_fan_out)


def fused_adapter(layer, x: torch.Tensor, kwargs: dict) -> str | None:
    """The one active adapter the fused path computes, or None where peft's forward must run."""
    if layer.disable_adapters or layer.merged or kwargs:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    base = layer.get_base_layer()
    a, b = layer.lora_A[name], layer.lora_B[name]
    if (type(a) is not nn.Linear or type(b) is not nn.Linear or _hooked(base) or _hooked(a) or _hooked(b)
            or _global_hooks() or not (_plain(base.weight) and _plain(a.weight) and _plain(b.weight))):
        return None
    if (name in layer.lora_variant or not isinstance(layer.lora_dropout[name], nn.Identity)
            or layer.lora_B[name].bias is not None or layer.lora_A[name].bias is not None
            or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)
            or x.dtype != base.weight.dtype or autocast_changes(x.device.type, x.dtype)):
        return None
    return name


def _global_hooks() -> bool:
    """Whether module hooks registered for every module (``register_module_forward_*_hook``) are set."""
    return bool(_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks)


class FusedLoraLinear(PeftLinear if PeftLinear is not None else nn.Module):
    """peft's ``lora.Linear`` with the same parameters and state-dict keys, whose forward is one
    autograd function where that computes what peft's would (see the module docstring)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = None if args else fused_adapter(self, x, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        return _LoraLinear.apply(x, base.weight, base.bias, self.lora_A[name].weight,
                                 self.lora_B[name].weight, float(self.scaling[name]))


def enable(model: nn.Module, **settings: Any) -> nn.Module:
    """Apply the ``lora`` switch to every plain peft LoRA Linear of ``model``; returns it. Layers
    keep their parameters, so an optimizer built before or after sees the same ones."""
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise TypeError(f"unknown optim.lora settings: {sorted(unknown)} (valid: {sorted(SWITCHES)})")
    mode = SWITCHES["lora"].resolve(settings.get("lora"))
    disable(model)
    layers = [m for m in model.modules() if fusable(m)]
    if mode == "fused":
        for m in layers:
            m.__class__ = FusedLoraLinear
    vars(owner(model))[_STATE] = {"lora": mode, "fused_layers": len(layers) if mode == "fused" else 0}
    return model


def disable(model: nn.Module) -> nn.Module:
    """Every fused layer back to peft's own class."""
    for m in model.modules():
        if type(m) is FusedLoraLinear:
            m.__class__ = PeftLinear
    vars(owner(model)).pop(_STATE, None)
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    """What enable() did, for result rows (empty when it was not applied)."""
    return dict(vars(owner(model)).get(_STATE, {}))
