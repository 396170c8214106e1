"""Shared pieces of tests/test_moe.py (CPU fp32) and tests/test_gpu_moe.py (CUDA bf16)."""

from __future__ import annotations

import torch

MODELS = {"gpt-oss-20b-tiny": "eager", "qwen3-30b-a3b-tiny": "sdpa"}
BACKENDS = ("loop", "sorted", "grouped_mm")


def build(name: str, device: str, dtype: torch.dtype, rank: int, gradient_checkpointing=False, seed=0):
    from harness.workload import models

    spec = models.get(name)
    model = models.build(
        spec, device=device, dtype=dtype, attn_implementation=MODELS[name], lora_rank=rank,
        gradient_checkpointing=gradient_checkpointing, seed=seed,
    )
    # peft initializes every lora_B to zero, which would make a wrong LoRA path look right.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).mul_(0.05).to(p))
    return model


def experts_of(model, layer=0):
    """The (peft-wrapped) experts module of one decoder layer."""
    return model.get_base_model().model.layers[layer].mlp.experts


def router_of(model, layer=0):
    mlp = model.get_base_model().model.layers[layer].mlp
    return mlp.router if hasattr(mlp, "router") else mlp.gate


def run_model(model, input_ids, params):
    """Loss, logits and the gradient of every named parameter in ``params``."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits
    # unshifted next-token-style loss so a 1-token sequence still has a target
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), input_ids.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    return loss.detach(), logits.detach(), grads


def run_experts(experts, hidden, idx, wts, params):
    """Call one experts module on explicit routing; output and grads (input, routing weights, params)."""
    hidden = hidden.detach().clone().requires_grad_(True)
    wts = wts.detach().clone().requires_grad_(True)
    for p in params.values():
        p.grad = None
    out = experts(hidden, idx, wts)
    # a non-uniform upstream gradient so every row's grad matters
    g = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    (out * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    grads["hidden"], grads["routing_weights"] = hidden.grad, wts.grad
    return out.detach(), grads


def routings(T: int, E: int, k: int, device):
    """Routing patterns for the edge cases: (name, router_indices)."""
    g = torch.Generator().manual_seed(0)
    rand = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    few = torch.stack([torch.tensor([0, 1][: k] + list(range(2, k)))] * T)  # experts >= k get nothing
    one = torch.full((T, k), 3)  # every pair on expert 3 (incl. the same expert twice per token)
    first = rand.clone()
    first[:, 0] = 5  # every token picks expert 5 (plus random others)
    first[:, 1:] = torch.where(first[:, 1:] == 5, (first[:, 1:] + 1) % E, first[:, 1:])
    out = [("random", rand), ("empty_experts", few), ("all_one_expert", one), ("all_pick_5", first)]
    out.append(("single_token", rand[:1]))
    return [(n, r.to(device)) for n, r in out]


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """||a - b|| / ||b||, with ||b|| floored: a gradient that is zero in exact math (q/k with a
    single token) is rounding noise on both sides and must not fail on its relative error."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()
