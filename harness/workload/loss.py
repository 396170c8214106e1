"""Causal-LM loss without materializing the full logits: the lm_head and cross-entropy run in
token chunks, each checkpointed, so at most one chunk's fp32 logits exist at a time.

With a 152k-word vocabulary the fp32 logits of a 24k-token batch are 14 GiB, and with their
gradient they set the peak of a LoRA step (REFERENCE.md saw it on Qwen3-8B). A measurement of
what *activation* offloading saves would then measure the logits instead. Memory-conscious
fine-tuning stacks compute the loss this way (chunked or fused cross-entropy); the value equals
transformers' ``ForCausalLMLoss`` (shift by one, ``-100`` ignored, mean over counted tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _ce_sum(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")


def _causal_lm(model):
    """The transformers *ForCausalLM inside a peft wrapper (or the model itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "lm_head") or not hasattr(base, "model"):
        raise TypeError(f"{type(base).__name__} is not a causal LM with .model and .lm_head")
    return base


def chunked_causal_lm_loss(model, input_ids, labels, *, chunk_tokens: int = 4096, **model_kwargs):
    """Mean next-token cross-entropy of ``model`` on ``input_ids`` against ``labels``."""
    base = _causal_lm(model)
    if getattr(base.lm_head, "bias", None) is not None:
        raise NotImplementedError("chunked loss: lm_head with a bias")
    hidden = base.model(input_ids=input_ids, use_cache=False, **model_kwargs).last_hidden_state
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shifted.reshape(-1).to(h.device)
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk_tokens):
        total = total + checkpoint(_ce_sum, h[i:i + chunk_tokens], y[i:i + chunk_tokens],
                                   base.lm_head.weight, use_reentrant=False)
    return total / (y != -100).sum().clamp(min=1)


def causal_lm_loss(model, input_ids, labels, *, chunked: bool, chunk_tokens: int = 4096, **model_kwargs):
    """The training loss of one step: chunked (above) or the model's own (full logits)."""
    if chunked:
        return chunked_causal_lm_loss(model, input_ids, labels, chunk_tokens=chunk_tokens, **model_kwargs)
    return model(input_ids=input_ids, labels=labels, use_cache=False, **model_kwargs).loss
