"""The training loss of one harness step: the model's own (full logits), or ``optim.loss``'s
chunked linear + cross-entropy called directly (``loss = "chunked"`` in an experiment).

With a 152k-word vocabulary the fp32 logits of a 24k-token batch are 14 GiB, and with their
gradient they set the peak of a LoRA step. A measurement of what *activation* offloading saves
would then measure the logits instead, so the offload experiment and the longest MoE points take
the chunked loss. It is the same function ``optim.enable`` patches into the model (switch
``fused_loss``); calling it here lets a variant pick it without the rest of optim.
"""

from __future__ import annotations

from optim.loss import causal_lm, linear_cross_entropy, shift_labels


def chunked_causal_lm_loss(model, input_ids, labels, *, chunk_tokens: int | None = None, **model_kwargs):
    """Mean next-token cross-entropy of ``model`` on ``input_ids`` against ``labels``, equal to
    transformers' ``ForCausalLMLoss``; ``chunk_tokens`` None takes ``optim.loss``'s chunk size."""
    base = causal_lm(model)
    if base is None:
        raise TypeError(f"{type(model).__name__} is not a causal LM with .model and .lm_head")
    if getattr(base.lm_head, "bias", None) is not None:
        raise NotImplementedError("chunked loss: lm_head with a bias")
    hidden = base.model(input_ids=input_ids, use_cache=False, **model_kwargs).last_hidden_state
    return linear_cross_entropy(hidden, base.lm_head.weight, shift_labels(labels), chunk=chunk_tokens)


def causal_lm_loss(model, input_ids, labels, *, chunked: bool, chunk_tokens: int | None = None, **model_kwargs):
    """The training loss of one step: chunked (above) or the model's own (full logits)."""
    if chunked:
        return chunked_causal_lm_loss(model, input_ids, labels, chunk_tokens=chunk_tokens, **model_kwargs)
    return model(input_ids=input_ids, labels=labels, use_cache=False, **model_kwargs).loss
