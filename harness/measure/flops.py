"""LoRA-aware FLOPs per training step, and MFU/HFU against a table of known peaks.

Per token, a LoRA step does a forward through every weight (2·N) and a backward that needs only
input gradients for frozen weights (2·N_frozen) but input and weight gradients for adapters
(4·N_adapter): ~4·N_frozen + 6·N_adapter. Attention adds 4·H·d_head FLOPs per attended
(query, key) pair in the forward (QKᵀ and PV), 2× that in the backward. With packing, the pairs
come from each document alone: Σ ℓ(ℓ+1)/2 causally, fewer under a sliding window.

MFU counts the model FLOPs; HFU adds the forward that gradient checkpointing recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peaks in FLOP/s, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "h100 sxm": 989.4e12,
    "h100 80gb hbm3": 989.4e12,
    "h100 pcie": 756.0e12,
    "h100 nvl": 835.0e12,
    "h200": 989.4e12,
    "gh200": 989.4e12,
    "b200": 2250e12,
    "a100": 312e12,
    "l40s": 362.05e12,
    "l4": 121e12,
}


def peak_flops(device_name: str) -> float | None:
    """The bf16 peak for a GPU name, or None if unknown: we refuse to guess."""
    name = device_name.lower().replace("nvidia", "").strip()
    # longest key first so "h100 pcie" wins over a shorter partial match
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


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
) -> StepFlops:
    """FLOPs of one step over ``tokens`` tokens; ``recompute`` is the share of the layers whose
    forward gradient checkpointing runs again (True: all, False: none).

    ``frozen_params``/``adapter_params`` are the matmul parameters each token passes through
    (for MoE, only the active experts' share). ``layer_windows`` has one entry per decoder layer:
    None for full attention, else the sliding window.
    """
    pairs = sum(attended_pairs(l, w) for w in layer_windows for l in doc_lengths)
    attn_fwd = 4.0 * num_heads * head_dim * pairs
    linear_fwd = 2.0 * (frozen_params + adapter_params) * tokens
    linear_bwd = 2.0 * frozen_params * tokens + 4.0 * adapter_params * tokens
    model = linear_fwd + linear_bwd + 3.0 * attn_fwd
    hardware = model + (linear_fwd + attn_fwd) * float(recompute)
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


def _is_tied(model) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def layer_windows(config) -> list[int | None]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types]
