"""The grouped_mm experts layer as one pure function for ``torch.compile`` (``moe_compile``), and
what ``moe_saved`` keeps of it for backward.

The eager grouped path (``_moe_ops.grouped_forward``) is host-bound on a GPU: ~60 kernels per
experts layer in the forward, more in the backward, each behind Python and dispatcher overhead,
and most of them elementwise (bias gathers, the gate, the routing weight). With static shapes (the
grouped path never reads a count on the host) the whole layer compiles into a handful of fused
kernels around the grouped GEMMs. The function takes only tensors and plain data, so the one
compiled graph serves every layer of the model. A compiler failure is recorded per device type and
dtype (``COMPILE_FAILED``) and the caller runs the next path.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from optim._fallback import recompile_limit
from optim._moe_ops import GMM, Grouping, aligned, raw_to_factors

log = logging.getLogger(__name__)


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
    if not aligned(a_t) or -a_t.shape[-1] % (16 // a_t.element_size()):
        a_t = a_t.contiguous()
    return _pad_rank(a_t, b_t)


def _proj_pure(x, offs, eids, w, b, lora):
    y = GMM(x, w.to(x.dtype), offs=offs)
    if b is not None:
        y = y + b.index_select(0, eids).to(y.dtype)
    for a_t, b_t, scaling in lora:
        y = y + GMM((GMM(x, a_t, offs=offs) * scaling).contiguous(), b_t, offs=offs)
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


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # not bool: a mask may pick large rows


def _on_integers(args, kwargs) -> bool:
    """An op that reads integer tensors only and makes integers: the routing's bookkeeping (a cast of
    an integer weight to float, or a mask, is not)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (bool(tensors) and all(t.dtype in _INDEX_DTYPES for t in tensors)
            and kwargs.get("dtype") in (None, *_INDEX_DTYPES))


def _lean_policy(ctx, op, *args, **kwargs):
    """Keep a grouped GEMM's output, the sum of two row blocks of one shape (the gate/up
    projection with its LoRA, or with its bias), and every op on the routing's integers (the sort
    order, the token index and, where biases are gathered, the expert ids: two or three int64 per
    routed row; the counts and offsets, a few per expert), which recomputing would sort again in
    backward; recompute the rest: the gather, the gate, the scaling and the
    weighting. Backward keeps of these only what it reads: the gate/up output
    (for the gate) and the LoRA middles (for the B factors); a GEMM output that a kept sum
    holds, and the down side's, it never reads."""
    from torch.utils.checkpoint import CheckpointPolicy

    if _on_integers(args, kwargs):
        return CheckpointPolicy.MUST_SAVE
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
