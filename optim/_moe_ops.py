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

from optim._fallback import recompile_limit

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

_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: set[str] = set()


def grouped_mm_available(device: torch.device | str) -> bool:
    """Whether a native grouped GEMM exists for ``device`` (dtype/stride checks come per call)."""
    device = torch.device(device)
    if _GMM is None:
        return False
    if device.type == "cuda":
        # torch <= 2.8's _grouped_mm is SM90-only; F.grouped_mm (>= 2.10) also runs on SM80+.
        cap = torch.cuda.get_device_capability(device)
        return cap >= (8, 0) if hasattr(F, "grouped_mm") else cap[0] == 9
    # torch 2.13 has a CPU kernel (fp32 and bf16, 16-byte aligned strides); torch <= 2.8 has none.
    return device.type == "cpu" and hasattr(F, "grouped_mm")


def _aligned(t: torch.Tensor) -> bool:
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
    if _GMM is not None and grouped_mm_available(x.device) and _aligned(x) and _aligned(w) and out_aligned:
        return _ContiguousGrad.apply(_GMM(x, w, offs=offs))
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
# The grouped path as one pure function, for torch.compile
# ---------------------------------------------------------------------------------------------
#
# The eager grouped path is host-bound on a GPU: ~60 kernels per experts layer in the forward,
# more in the backward, each behind Python and dispatcher overhead, and most of them elementwise
# (bias gathers, the gate, the routing weight). With static shapes
# (the grouped path never reads a count on the host) the whole layer compiles into a handful of
# fused kernels around the grouped GEMMs. The function takes only tensors and plain data, so the
# one compiled graph serves every layer of the model.


def gate_spec(mod) -> tuple | None:
    """The module's gate as plain data (``None`` if we do not know it: the eager path runs)."""
    fn = getattr(type(mod), "_apply_gate", None)
    qual = getattr(fn, "__qualname__", "")
    if qual == "GptOssExperts._apply_gate" and hasattr(mod, "alpha") and hasattr(mod, "limit"):
        return ("gpt_oss", float(mod.alpha), float(mod.limit))
    if qual == "_default_apply_gate" and getattr(mod.config, "hidden_act", None) in ("silu", "swish"):
        return ("silu_glu",)
    return None


def apply_gate(h: torch.Tensor, spec: tuple) -> torch.Tensor:
    if spec[0] == "gpt_oss":  # interleaved gate/up, clamped, swish with alpha, (up + 1)
        _, alpha, limit = spec
        gate = h[..., ::2].clamp(max=limit)
        up = h[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


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


def _pad_rank(a_t: torch.Tensor, b_t: torch.Tensor):
    """Zero-pad the LoRA rank to a 16-byte multiple (grouped_mm's stride rule): X·A·B unchanged."""
    step = 16 // a_t.element_size()
    pad = -a_t.shape[-1] % step
    if pad:
        a_t = F.pad(a_t, (0, pad))
        b_t = F.pad(b_t, (0, 0, 0, pad))
    return a_t, b_t


def compile_factors(wa, wb, num_experts: int, dtype: torch.dtype):
    """The LoRA factors as the compiled path takes them, laid out eagerly: inductor may pick its
    own strides for a permute + contiguous inside the graph, which grouped_mm then rejects.
    A_t stays a column-major view where grouped_mm can read it (16-byte strides, a rank that
    needs no padding); otherwise it is made contiguous and padded."""
    a_t, b_t = raw_to_factors(wa, wb, num_experts, dtype)
    if not _aligned(a_t) or -a_t.shape[-1] % (16 // a_t.element_size()):
        a_t = a_t.contiguous()
    return _pad_rank(a_t, b_t)


def _proj_pure(x, offs, eids, w, b, lora):
    y = _GMM(x, w.to(x.dtype), offs=offs)
    if b is not None:
        y = y + b.index_select(0, eids).to(y.dtype)
    for a_t, b_t, scaling in lora:
        y = y + _GMM((_GMM(x, a_t, offs=offs) * scaling).contiguous(), b_t, offs=offs)
    return y


def grouped_pure(hidden, router_indices, routing_weights, w_gu, b_gu, w_d, b_d, lora_gu, lora_d,
                 gate: tuple, num_experts: int, lean: bool = False) -> torch.Tensor:
    """The grouped_mm experts layer from tensors and plain data only (no module, no host sync).
    ``w_*``: (E, in, out) views; ``b_*``: (E, out) or None; ``lora_*``: [(A_t, B_t, scaling)]
    with contiguous (E, in, r) / (E, r, out) factors, rank padded (``compile_factors``).

    ``lean`` (``moe_saved="lean"``): the layer as a selective checkpoint that keeps the grouped
    GEMMs' outputs and recomputes everything else in backward (``_lean_body``)."""
    args = (hidden, router_indices, routing_weights, w_gu, b_gu, w_d, b_d, lora_gu, lora_d, gate, num_experts)
    if lean:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_lean_body, *args, use_reentrant=False, context_fn=_lean_contexts)
    return _body(*args)


def _body(hidden, router_indices, routing_weights, w_gu, b_gu, w_d, b_d, lora_gu, lora_d, gate, num_experts):
    g = Grouping(router_indices, num_experts)
    x, w = g.gather(hidden, routing_weights)
    h = _proj_pure(x.contiguous(), g.offs, g.eids, w_gu, b_gu, lora_gu)
    h = apply_gate(h, gate).contiguous()
    y = _proj_pure(h, g.offs, g.eids, w_d, b_d, lora_d) * w[:, None]
    return g.combine(y).to(hidden.dtype)


def _lean_body(hidden, router_indices, routing_weights, w_gu, b_gu, w_d, b_d, lora_gu, lora_d, gate, num_experts):
    """``_body`` with the routing weights on the down projection's input rows, ``(h·w)·W_d + w·b_d``
    for ``(h·W_d + b_d)·w``: their gradient then reads the gate's output, which backward
    recomputes from the gate/up GEMM's kept output, and not the down GEMM's output, which it could
    not without that GEMM."""
    g = Grouping(router_indices, num_experts)
    x, w = g.gather(hidden, routing_weights)
    h = _proj_pure(x.contiguous(), g.offs, g.eids, w_gu, b_gu, lora_gu)
    hw = (apply_gate(h, gate) * w[:, None]).to(h.dtype).contiguous()
    y = _proj_pure(hw, g.offs, g.eids, w_d, None, lora_d)
    if b_d is not None:
        y = y + (b_d.index_select(0, g.eids) * w[:, None]).to(y.dtype)
    return g.combine(y).to(hidden.dtype)


def lean_fits(router_indices: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``moe_saved="lean"``'s graph can take this batch: its routed rows (tokens × top-k)
    a multiple of 16 bytes of ``dtype``. Lean's backward recomputes the gathered rows, and inductor
    may lay them out already transposed for the weight gradients' grouped GEMMs, (hidden, rows) with
    a row stride of ``rows`` elements, which grouped_mm refuses unless it is a 16-byte multiple (seen
    on CUDA at 20 rows of bf16: gpt-oss-20b's tiny twin, top-2, 10 tokens; for gpt-oss-20b, top-4,
    any odd token count). The partitioner's graph keeps those rows as they were computed, (rows,
    hidden), and takes any count: such a batch runs it, with its memory. A shape only: no device
    sync."""
    return (router_indices.numel() * dtype.itemsize) % 16 == 0


def _lean_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_lean_policy)


def _lean_policy(ctx, op, *args, **kwargs):
    """Keep a grouped GEMM's output, and the sum of two row blocks of one shape (the gate/up
    projection with its LoRA, or with its bias); recompute the rest: the gather, the gate, the
    scaling and the weighting. Backward keeps of these only what it reads: the gate/up output
    (for the gate) and the LoRA middles (for the B factors); a GEMM output that a kept sum
    holds, and the down side's, it never reads."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.aten._grouped_mm.default:
        return CheckpointPolicy.MUST_SAVE
    if (op is torch.ops.aten.add.Tensor and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2])
            and args[0].dim() >= 2 and args[0].shape == args[1].shape):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_compiled = None
# (device type, dtype) -> the error; (device type, dtype, "lean") for moe_saved="lean"'s graph, so
# that a failure of that one leaves the default compiled path on
COMPILE_FAILED: dict[tuple, str] = {}


def _failed_key(device: torch.device, dtype: torch.dtype, lean: bool) -> tuple:
    return (device.type, dtype, "lean") if lean else (device.type, dtype)


def compiled_grouped(device: torch.device, dtype: torch.dtype, lean: bool = False):
    """``grouped_pure`` under torch.compile (one per process), or None where compiling failed
    before for this device type and dtype (``lean``, a constant, compiles a graph of its own and
    fails on its own)."""
    if _failed_key(device, dtype, lean) in COMPILE_FAILED:
        return None
    global _compiled
    if _compiled is None:
        fn = torch.compile(grouped_pure, fullgraph=True)

        def call(*args):
            with recompile_limit():
                return fn(*args)

        _compiled = call
    return _compiled


def compile_failed(device: torch.device, dtype: torch.dtype, err: BaseException, lean: bool = False) -> None:
    msg = f"{type(err).__name__}: {err}"
    COMPILE_FAILED[_failed_key(device, dtype, lean)] = msg
    log.warning("optim.moe: torch.compile of the grouped experts%s failed on %s/%s (%s); %s runs instead",
                " (moe_saved=lean)" if lean else "", device.type, dtype, msg.splitlines()[0][:300],
                "the partitioner's graph (moe_saved=all)" if lean else "the eager grouped path")


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
