"""LoRA-aware FLOPs per training step, and MFU/HFU against a table of known peaks.

Per token, a LoRA step does a forward through every weight (2·N) and a backward that needs only
input gradients for frozen weights (2·N_frozen) but input and weight gradients for adapters
(4·N_adapter): ~4·N_frozen + 6·N_adapter. Attention adds 4·H·d_head FLOPs per attended
(query, key) pair in the forward (QKᵀ and PV), 2× that in the backward. With packing, the pairs
come from each document alone: Σ ℓ(ℓ+1)/2 causally, fewer under a sliding window.

MFU counts the model FLOPs; HFU adds the forward that gradient checkpointing recomputes: the
decoder layers', not the lm_head's (it and the loss run once). ``FLOPS_VERSION`` 2 is that count;
rows of version 1 (no ``flops_version``) counted the lm_head as recomputed too, so ``hfu_of``
gives no HFU for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FLOPS_VERSION = 2  # 2: the lm_head is not counted as recomputed (1 counted it)

# Dense bf16 tensor-core peaks in FLOP/s, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "h100 sxm": 989.4e12,
    "h100 80gb hbm3": 989.4e12,
    "h100 pcie": 756.0e12,
    "h100 nvl": 835.5e12,
    "h200": 989.4e12,
    "h200 nvl": 835.5e12,
    "gh200": 989.4e12,
    "b200": 2250e12,
    "a100": 312e12,
    "l40s": 362.05e12,
    "l40": 181.05e12,
    "l4": 121e12,
}


def peak_flops(device_name: str) -> float | None:
    """The bf16 peak for a GPU name, or None if unknown: we refuse to guess."""
    words = set(re.split(r"[\s_-]+", device_name.lower().replace("nvidia", "").strip()))
    # whole words only ("l4" is not in "l40"), the most specific key first ("h100 pcie" before "h100")
    for key in sorted(PEAK_BF16_FLOPS, key=lambda k: (len(k.split()), len(k)), reverse=True):
        if set(key.split()) <= words:
            return PEAK_BF16_FLOPS[key]
    return None


def hfu_of(row: dict) -> float | None:
    """A row's HFU where the FLOP count it was computed with is the current one, else None."""
    return row.get("hfu") if (row.get("flops_version") or 1) >= FLOPS_VERSION else None


def attended_pairs(length: int, window: int | None = None) -> int:
    """Causal (query, key) pairs in one document, under an optional sliding window."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    # the first `window` queries see 1..window keys, the rest see exactly `window`
    return window * (window + 1) // 2 + (length - window) * window


@dataclass(frozen=True)
class StepFlops:
    model_flops: float  # what the step must do: used for MFU
    hardware_flops: float  # plus checkpoint recompute: used for HFU
    matmul_params_frozen: int
    matmul_params_adapter: int
    attention_fwd_flops: float


def step_flops(
    *,
    tokens: int,
    frozen_params: int,
    adapter_params: int,
    doc_lengths: list[int],
    layer_windows: list[int | None],
    num_heads: int,
    head_dim: int,
    recompute: float,
    head_params: int = 0,
) -> StepFlops:
    """FLOPs of one step over ``tokens`` tokens; ``recompute`` is the share of the layers whose
    forward gradient checkpointing runs again (True: all, False: none); ``head_params`` are the
    part of ``frozen_params`` and ``adapter_params`` in the output projection, which no
    checkpoint recomputes.

    ``frozen_params``/``adapter_params`` are the matmul parameters each token passes through
    (for MoE, only the active experts' share). ``layer_windows`` has one entry per decoder layer:
    None for full attention, else the sliding window.
    """
    pairs = sum(attended_pairs(l, w) for w in layer_windows for l in doc_lengths)
    attn_fwd = 4.0 * num_heads * head_dim * pairs
    linear_fwd = 2.0 * (frozen_params + adapter_params) * tokens
    linear_bwd = 2.0 * frozen_params * tokens + 4.0 * adapter_params * tokens
    model = linear_fwd + linear_bwd + 3.0 * attn_fwd
    layers_fwd = linear_fwd - 2.0 * head_params * tokens  # what a recompute runs again
    hardware = model + (layers_fwd + attn_fwd) * float(recompute)
    return StepFlops(model, hardware, frozen_params, adapter_params, attn_fwd)


def matmul_params(model, num_experts: int = 0, experts_per_token: int = 0) -> tuple[int, int]:
    """(frozen, adapter) parameters a token passes through in matmuls.

    Embedding lookups are not matmuls and are left out, but a tied embedding is the output
    projection too, so it is counted once. Expert weights count at their routed share k/E.
    1-D parameters (norms, biases) are negligible and skipped.
    """
    frozen = adapter = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or p.dim() < 2:
            continue
        seen.add(id(p))
        is_embedding = "embed_tokens" in name
        if is_embedding and not _is_tied(model):
            continue
        n = p.numel()
        if ".experts." in name and num_experts:
            # a LoRA on a 3-D expert weight spans all experts too
            n = n * experts_per_token // num_experts
        if p.requires_grad:
            adapter += n
        else:
            frozen += n
    return frozen, adapter


def head_params(model) -> int:
    """The output projection's matmul parameters (lm_head, or the tied embedding), an adapter on
    it included: part of ``matmul_params``' count, and run once a step whatever is checkpointed."""
    n = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or p.dim() < 2:
            continue
        seen.add(id(p))
        if "lm_head" in name or ("embed_tokens" in name and _is_tied(model)):
            n += p.numel()
    return n


def _is_tied(model) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def layer_windows(config) -> list[int | None]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types]
