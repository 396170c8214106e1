"""Routing and expert-GEMM primitives behind ``optim.moe``.

Three ways to run one MoE experts layer, all producing the same numbers:

- ``loop``: one ``torch.where(router_indices == e)`` per expert (the published reference). Every
  ``where`` has a data-dependent output size, so the host waits for the device once per expert.
- ``sorted``: group all (token, expert) pairs once: a stable argsort of the flattened expert ids
  and one count per expert, then contiguous per-expert slices. The counts are read on the host
  once (``.tolist()``) to cut the slices: one sync per layer, whatever the number of experts.
- ``grouped_mm``: the same grouping, but the per-expert GEMMs are one ``grouped_mm`` that takes
  the offsets as a device tensor: no host sync at all.

Every backend accepts optional split-LoRA factors per projection (``lora[name]`` = list of
``(A_t, B_t, scaling)`` with ``A_t: (E, in, r)``, ``B_t: (E, r, out)``) and adds
``scaling * (x @ A_t[e]) @ B_t[e]`` on the routed rows only, so B·A is never formed.

The explicit host-sync points are counted in ``SYNC_COUNTER`` so the sync count per forward can
be read on any device (on CUDA the bench also cross-checks with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PROJECTIONS = ("gate_up_proj", "down_proj")


class _SyncCounter:
    """Counts the host syncs this module asks for (``.tolist()``, data-dependent ``where``)."""

    def __init__(self) -> None:
        self.count = 0

    def note(self, n: int = 1) -> None:
        self.count += n


SYNC_COUNTER = _SyncCounter()


# ---------------------------------------------------------------------------------------------
# grouped_mm: torch.nn.functional.grouped_mm (torch >= 2.10) or torch._grouped_mm (2.8/2.9)
# ---------------------------------------------------------------------------------------------

GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: set[str] = set()


def grouped_mm_available(device: torch.device | str) -> bool:
    """Whether a native grouped GEMM exists for ``device`` (dtype/stride checks come per call)."""
    device = torch.device(device)
    if GMM is None:
        return False
    if device.type == "cuda":
        # torch <= 2.8's _grouped_mm is SM90-only; F.grouped_mm (>= 2.10) also runs on SM80+.
        cap = torch.cuda.get_device_capability(device)
        return cap >= (8, 0) if hasattr(F, "grouped_mm") else cap[0] == 9
    # torch 2.13 has a CPU kernel (fp32 and bf16, 16-byte aligned strides); torch <= 2.8 has none.
    return device.type == "cpu" and hasattr(F, "grouped_mm")


def aligned(t: torch.Tensor) -> bool:
    """Whether grouped_mm takes ``t`` as it is. Its kernels read rows or columns with 16-byte
    vector loads: the base pointer 16-byte aligned, and each matrix row-major (last stride 1) or
    column-major (the one before it 1), with the other stride spanning the contiguous dim and a
    16-byte multiple, whatever the sizes (a (1, 36) bf16 row has a 72-byte stride and is
    refused). Batch strides are held to 16-byte multiples too."""
    if t.dim() < 2 or t.data_ptr() % 16:
        return False
    align = 16 // t.element_size()
    (s_m, s_n), (n_m, n_n) = t.stride()[-2:], t.shape[-2:]
    if s_n == 1 and s_m >= max(1, n_n):  # row-major, tried first as the kernel does
        inner = s_m
    elif s_m == 1 and s_n >= max(1, n_m):  # column-major
        inner = s_n
    else:
        return False
    return inner % align == 0 and all(s % align == 0 for s, n in zip(t.stride()[:-2], t.shape[:-2]) if n > 1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects expanded gradients (stride 0), which a plain ``.sum()`` loss produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _gmm_fallback(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    outs = [xs @ w[e] for e, xs in enumerate(torch.split(x, counts)) if xs.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


def gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None = None):
    """``out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]`` for every expert e.

    x: (S, in) sorted by expert; w: (E, in, out), may be a transposed view; offs: int32 (E,)
    cumulative row counts on x's device. Falls back to per-slice matmuls (one host sync to read
    the offsets) where the native kernel cannot run: no kernel for the device, or unaligned strides.
    """
    w = w.to(x.dtype)
    out_aligned = (w.shape[-1] * w.element_size()) % 16 == 0  # the output's rows (and their gradient's)
    if GMM is not None and grouped_mm_available(x.device) and aligned(x) and aligned(w) and out_aligned:
        return _ContiguousGrad.apply(GMM(x, w, offs=offs))
    key = f"{x.device.type}/{x.dtype}/{tuple(x.stride())}/{tuple(w.stride())}"
    if key not in _warned:
        _warned.add(key)
        log.warning("optim.moe: native grouped_mm unavailable for %s; per-expert fallback", key)
    if counts is None:
        SYNC_COUNTER.note()
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return _gmm_fallback(x, w, counts)


# ---------------------------------------------------------------------------------------------
# The expert MLP on one expert's rows (loop, sorted) or on all sorted rows at once (grouped)
# ---------------------------------------------------------------------------------------------


def weight_of(mod, name: str) -> torch.Tensor:
    """(E, in, out) view of an expert weight. gpt-oss stores it that way (``is_transposed``);
    Qwen3-MoE stores (E, out, in) for ``F.linear``. In peft's merged mode this reads the
    parametrized W + B·A."""
    w = getattr(mod, name)
    return w if mod.is_transposed else w.transpose(-2, -1)


def expert_weights(mod) -> dict[str, torch.Tensor]:
    return {name: weight_of(mod, name) for name in PROJECTIONS}


def _proj_slice(mod, name, x, e, W, lora):
    y = x @ W[name][e]
    if mod.has_bias:
        y = y + getattr(mod, f"{name}_bias")[e]
    for a_t, b_t, scaling in lora.get(name, ()):
        y = y + ((x @ a_t[e].to(x.dtype)) * scaling) @ b_t[e].to(x.dtype)
    return y


def expert_mlp_slice(mod, x: torch.Tensor, e: int, W, lora) -> torch.Tensor:
    """One expert's MLP on its rows: gate_up (+bias, +LoRA), the module's own gate, down."""
    h = mod._apply_gate(_proj_slice(mod, "gate_up_proj", x, e, W, lora))
    return _proj_slice(mod, "down_proj", h, e, W, lora)


def _proj_grouped(mod, name, x, offs, eids, W, lora):
    y = gmm(x, W[name], offs)
    if mod.has_bias:
        # One gathered bias row per (token, expert) pair: the kernel has no per-group bias.
        y = y + getattr(mod, f"{name}_bias").index_select(0, eids).to(y.dtype)
    for a_t, b_t, scaling in lora:
        # (x @ A_e) then @ B_e: S·r intermediates instead of the E·in·out delta B·A.
        y = y + gmm((gmm(x, a_t, offs) * scaling).contiguous(), b_t, offs)
    return y


def expert_mlp_grouped(mod, x, offs, eids, W, lora) -> torch.Tensor:
    h = _proj_grouped(mod, "gate_up_proj", x, offs, eids, W, lora.get("gate_up_proj", ()))
    h = mod._apply_gate(h).contiguous()
    return _proj_grouped(mod, "down_proj", h, offs, eids, W, lora.get("down_proj", ()))


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def _unpermute_sum(rows: torch.Tensor, perm: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows in sorted order put back in (token, slot) pair order (``perm`` is a permutation: one
    scatter, deterministic, no atomics), then summed over each token's ``top_k`` slots."""
    pairs = rows.new_empty(rows.shape).index_copy(0, perm, rows)
    return pairs if top_k == 1 else pairs.view(rows.shape[0] // top_k, top_k, *rows.shape[1:]).sum(dim=1)


class _GatherPairs(torch.autograd.Function):
    """``src.index_select(0, perm // top_k)``: each row of ``src`` read ``top_k`` times, in the
    order ``perm`` sorts the (row, slot) pairs. Its backward is the combine's
    (``perm`` is a permutation): one scatter of the gradient rows to pair order, no atomics, and
    a sum over the k slots. ``index_select``'s own backward is an ``index_add``: bf16 atomics, slow
    on a GPU, that sum in an order that varies from run to run."""

    @staticmethod
    def forward(ctx, src, perm, top_k):
        ctx.save_for_backward(perm)
        ctx.top_k = top_k
        return src.index_select(0, perm // top_k if top_k > 1 else perm)

    @staticmethod
    def backward(ctx, grad):
        (perm,) = ctx.saved_tensors
        return _unpermute_sum(grad, perm, ctx.top_k), None, None


class Grouping:
    """All (token, slot) pairs of one layer grouped by expert, built without a host sync."""

    def __init__(self, router_indices: torch.Tensor, num_experts: int):
        flat = router_indices.reshape(-1)
        self.top_k = router_indices.shape[-1]
        # Stable: within one expert the pairs keep token order, so results do not depend on
        # the sort implementation and ties between equal expert ids are broken the same way.
        self.perm = torch.argsort(flat, stable=True)
        self.eids = flat.index_select(0, self.perm)
        # The "bincount": scatter_add into E bins. torch.bincount on CUDA sizes its output with
        # input.max().item(), a hidden sync; scatter_add into a fixed E never syncs.
        self.counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        self.counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.offs = torch.cumsum(self.counts, 0, dtype=torch.int32)

    def counts_host(self) -> list[int]:
        SYNC_COUNTER.note()  # the one sync of the sorted backend
        return self.counts.tolist()

    def gather(self, hidden: torch.Tensor, routing_weights: torch.Tensor):
        x = _GatherPairs.apply(hidden, self.perm, self.top_k)
        w = _GatherPairs.apply(routing_weights.reshape(-1), self.perm, 1)
        return x, w

    def combine(self, out_sorted: torch.Tensor) -> torch.Tensor:
        return _unpermute_sum(out_sorted, self.perm, self.top_k)  # (num_tokens, hidden)


def loop_forward(mod, hidden, router_indices, routing_weights, lora) -> torch.Tensor:
    """Reference: one data-dependent ``torch.where`` per expert (E host syncs per layer)."""
    if hidden.shape[0] == 0:  # nothing routed: an empty result still in the graph, as the grouped paths give
        return hidden * routing_weights.sum(-1, keepdim=True).to(hidden.dtype)
    W = expert_weights(mod)
    top_k = router_indices.shape[-1]
    out = torch.zeros_like(hidden)
    for e in range(mod.num_experts):
        token_idx, slot = torch.where(router_indices == e)
        SYNC_COUNTER.note()
        if token_idx.numel() == 0:  # size already known on the host after the where
            continue
        # index_select rather than advanced indexing: its backward is an index_add, while
        # advanced indexing's backward (index_put with accumulate) may sort and sync on CUDA.
        y = expert_mlp_slice(mod, hidden.index_select(0, token_idx), e, W, lora)
        y = y * routing_weights.reshape(-1).index_select(0, token_idx * top_k + slot)[:, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def sorted_forward(mod, hidden, router_indices, routing_weights, lora) -> torch.Tensor:
    """Group once, one host sync (the per-expert counts), then contiguous per-expert slices."""
    W = expert_weights(mod)
    g = Grouping(router_indices, mod.num_experts)
    counts = g.counts_host()
    x, w = g.gather(hidden, routing_weights)
    outs = [
        expert_mlp_slice(mod, xs, e, W, lora)
        for e, xs in enumerate(torch.split(x, counts))
        if xs.shape[0]  # experts with no tokens contribute no rows and no work
    ]
    y = (torch.cat(outs) if outs else x) * w[:, None]  # no rows at all: x is the (0, hidden) result
    return g.combine(y).to(hidden.dtype)


def grouped_forward(mod, hidden, router_indices, routing_weights, lora) -> torch.Tensor:
    """Group once and run every expert GEMM as one grouped_mm with device offsets: no sync."""
    W = expert_weights(mod)
    g = Grouping(router_indices, mod.num_experts)
    x, w = g.gather(hidden, routing_weights)
    y = expert_mlp_grouped(mod, x.contiguous(), g.offs, g.eids, W, lora) * w[:, None]
    return g.combine(y).to(hidden.dtype)


# ---------------------------------------------------------------------------------------------
# peft's stored LoRA weights as per-expert factors (the eager paths; _moe_compiled lays them out
# for the compiled one)
# ---------------------------------------------------------------------------------------------


class _ExpertMinorFactor(torch.autograd.Function):
    """peft's ``lora_B`` weight, (out, r·E) with the expert index fastest, as a contiguous
    (E, r, out) factor in ``dtype``: one cast-and-relayout kernel forward, one back. A cast and a
    ``.contiguous()`` are two kernels forward, and their backward two more (the cast, then a
    reshape that copies), each over the whole factor, in every layer and every step."""

    @staticmethod
    def forward(ctx, wb, num_experts, dtype):
        ctx.wb_dtype = wb.dtype
        out = wb.new_empty((num_experts, wb.shape[1] // num_experts, wb.shape[0]), dtype=dtype)
        return out.copy_(wb.reshape(wb.shape[0], -1, num_experts).permute(2, 1, 0))

    @staticmethod
    def backward(ctx, grad):
        num_experts, rank, out = grad.shape
        gw = grad.new_empty((out, rank * num_experts), dtype=ctx.wb_dtype)
        gw.view(out, rank, num_experts).permute(2, 1, 0).copy_(grad)
        return gw, None, None


def raw_to_factors(wa: torch.Tensor, wb: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """peft's stored LoRA weights to the (E, in, r) and (E, r, out) factors (see lora_factors).

    A_t is a transposed view of the cast ``lora_A`` (expert-major, so each expert's (in, r) is
    column-major, which the matmuls and grouped_mm read as it is): one cast each way, no copy.
    B_t needs a real relayout (``_ExpertMinorFactor``)."""
    a_t = wa.to(dtype).reshape(num_experts, -1, wa.shape[-1]).transpose(1, 2)
    return a_t, _ExpertMinorFactor.apply(wb, num_experts, dtype)


def dispatch_only(backend: str, hidden, router_indices, routing_weights, num_experts):
    """The routing path without expert GEMMs (gather rows per expert, weight, scatter back):
    isolates the dynamic-query overhead for the microbenchmark."""
    if backend == "loop":
        out = torch.zeros_like(hidden)
        for e in range(num_experts):
            token_idx, slot = torch.where(router_indices == e)
            SYNC_COUNTER.note()
            if token_idx.numel() == 0:
                continue
            w = routing_weights.reshape(-1).index_select(0, token_idx * router_indices.shape[-1] + slot)
            y = hidden.index_select(0, token_idx) * w[:, None]
            out.index_add_(0, token_idx, y)
        return out
    g = Grouping(router_indices, num_experts)
    x, w = g.gather(hidden, routing_weights)
    if backend == "sorted":
        counts = g.counts_host()
        x = torch.cat([xs for xs in torch.split(x, counts) if xs.shape[0]])
    return g.combine(x * w[:, None])


BACKENDS = {"loop": loop_forward, "sorted": sorted_forward, "grouped_mm": grouped_forward}
