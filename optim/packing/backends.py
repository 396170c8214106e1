"""The packed attention kernels: SDPA with the cached mask, flex_attention's fused kernel on
the cached BlockMask (with its fall-back), and FlashAttention-2 varlen; each applies gpt-oss's
sinks exactly. ``resolve_backend`` turns the ``auto`` choice into one of them."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from optim._fallback import passes_through, recompile_limit
from optim.packing.metadata import CAPTURE_PATHS, KERNEL_CALLS
from optim.packing.structures import build_flex_block_mask, build_sdpa_mask, build_varlen_args, cached_structure

log = logging.getLogger("optim.packing")


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)


def _sdpa(entry, q, k, v, scale, window, sinks, cache):
    B, H, T, D = q.shape
    k, v = _repeat_kv(k, H // k.shape[1]), _repeat_kv(v, H // v.shape[1])
    sink_cols = 0 if sinks is None else 1
    mask = cached_structure(entry, ("sdpa", window, q.dtype, sink_cols),
                      lambda: build_sdpa_mask(entry, window, q.dtype, sink_cols), cache)
    if sinks is not None:
        # Exact sinks with SDPA, which returns no log-sum-exp: append one "sink" key per head whose
        # score is exactly sink_h and whose value is 0. It adds exp(sink) to the softmax
        # denominator only, which is the definition of a sink, and autograd gives exact gradients
        # for q, k, v and the sinks. Head dim is padded by 8 zero columns (alignment); only the
        # first extra column is used: q gets 1 there, the sink key gets sink_h / scale.
        pad = 8
        extra_q = torch.zeros(B, H, T, pad, dtype=q.dtype, device=q.device)
        extra_q[..., 0] = 1
        q = torch.cat([q, extra_q], -1)
        k = torch.cat([k, torch.zeros(B, H, T, pad, dtype=k.dtype, device=k.device)], -1)
        sink_key = torch.zeros(B, H, 1, D + pad, dtype=k.dtype, device=k.device)
        sink_key = sink_key + F.pad((sinks.to(k.dtype) / scale).view(1, H, 1, 1), (D, pad - 1))
        k = torch.cat([k, sink_key], 2)
        v = F.pad(v, (0, pad, 0, 1))  # sink value 0; pad head dim to match q/k
    KERNEL_CALLS["sdpa-mask"] += 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if sinks is not None:
        out = out[..., :D]
    return out.transpose(1, 2).contiguous()


# flex_attention has two implementations. Compiled, it is one fused Triton kernel that skips
# masked blocks and never holds the scores. Called eagerly, it materializes the B×H×T×T scores:
# O(T²) memory (27.9 GB for a 16K-token forward of a tiny Llama) and a far slower step. So on
# CUDA the fused kernel runs or another packed kernel does, never the eager one:
#
# - It is compiled as a function of this module's own (``_fused_flex_body``), not as
#   ``torch.compile(flex_attention)``. dynamo keeps one cache per code object, with a limit of 8
#   entries by default, and every ``torch.compile(flex_attention)`` in the process shares
#   flex_attention's: transformers' own flex path compiles it with ``dynamic=False``, one entry per
#   shape. Once that cache was full, dynamo ran our call eagerly, with only a warning from torch
#   (the GPU suite, after the stock-flex tests). Our cache holds our entries alone, with the limit
#   of optim's compiled paths (``optim._fallback.RECOMPILE_LIMIT``).
# - If dynamo still runs it eagerly (the limit reached, dynamo disabled, an eager stance), the body
#   notices before flex_attention runs (``torch.compiler.is_compiling()`` is False) and says so; a
#   compiler error is caught the same way. Either way optim.packing logs one line and runs varlen
#   for the rest of the process, or raises ``FusedFlexUnavailable`` where varlen cannot run.
# - ``kernels()`` counts the calls of each kernel that ran; result rows record it.
#
# On CPU the eager flex is the only one with a backward; it runs there, counted as unfused.

_FLEX_COMPILE_BACKEND = "inductor"  # the fused kernel is inductor's; CPU tests of the fallback swap it
_fused_flex_compiled = None
_fused_flex_failed: str | None = None  # why the fused kernel cannot run in this process


class FusedFlexUnavailable(RuntimeError):
    """flex_attention's fused kernel cannot run here, and no other packed kernel can stand in."""


class _RanEager(Exception):
    """dynamo ran the fused-flex body as plain Python: flex_attention would take its unfused path."""


def flex_core(flex, q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    """One flex_attention call, (out, lse or None); ``flex`` is traced or compiled by the caller."""
    if not want_lse:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa), None
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                    return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _fused_flex_body(q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    if not torch.compiler.is_compiling():  # a constant True wherever dynamo traces this
        raise _RanEager
    from torch.nn.attention.flex_attention import flex_attention

    return flex_core(flex_attention, q, k, v, block_mask, scale, gqa, want_lse)


def fused_flex_failure() -> str | None:
    """Why flex_attention's fused kernel cannot run in this process (None while it can)."""
    return _fused_flex_failed


def _fused_flex(q, k, v, block_mask, scale, gqa: bool, want_lse: bool):
    """(out, lse) from the fused kernel, or None once it cannot be had (the reason is kept)."""
    global _fused_flex_compiled, _fused_flex_failed
    if _fused_flex_failed is not None:
        return None
    if _fused_flex_compiled is None:
        _fused_flex_compiled = torch.compile(_fused_flex_body, fullgraph=True, backend=_FLEX_COMPILE_BACKEND)
    try:
        with recompile_limit():
            return _fused_flex_compiled(q, k, v, block_mask, scale, gqa, want_lse)
    except _RanEager:
        why = "torch.compile ran it eagerly (dynamo disabled, or an eager stance)"
    except Exception as e:  # a compiler failure (or the recompile limit) must not stop training
        if passes_through(e):
            raise
        msg = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    _fused_flex_failed = why
    return None


def _flex(entry, q, k, v, scale, window, sinks, cache):
    block_mask = cached_structure(entry, ("flex", window), lambda: build_flex_block_mask(entry, window), cache)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        from torch.nn.attention.flex_attention import flex_attention

        KERNEL_CALLS["flex-unfused"] += 1
        out, lse = flex_core(flex_attention, q, k, v, block_mask, scale, gqa, sinks is not None)
        return flex_output(out, lse, sinks, q.dtype)
    res = _fused_flex(q, k, v, block_mask, scale, gqa, sinks is not None)
    if res is None:
        return _flex_stand_in(entry, q, k, v, scale, window, sinks, cache)
    KERNEL_CALLS["flex-fused"] += 1
    return flex_output(*res, sinks, q.dtype)


_stand_in_logged = False


def _flex_stand_in(entry, q, k, v, scale, window, sinks, cache):
    """varlen in place of a fused flex that cannot run; never the unfused flex."""
    global _stand_in_logged
    why = _fused_flex_failed
    if q.dtype not in (torch.float16, torch.bfloat16) or not varlen_available():
        raise FusedFlexUnavailable(
            f"optim.packing: flex_attention's fused kernel cannot run ({why}), and the varlen kernel "
            f"cannot stand in ({q.dtype}, varlen needs fp16/bf16 and a CUDA flash kernel). The unfused "
            "flex_attention would hold B x H x T x T scores, so it is not used; pick "
            "packing_backend='sdpa' (a T x T mask) or fix the cause above")
    if not _stand_in_logged:
        _stand_in_logged = True
        log.warning("optim.packing: flex_attention's fused kernel cannot run (%s); running the varlen "
                    "kernel instead for the rest of this process (the unfused flex would hold T x T "
                    "scores)", why)
    return _varlen(entry, q, k, v, scale, window, sinks, cache)


def flex_output(out, lse, sinks, dtype):
    """(B, H, T, D) -> (B, T, H, D), with exact sinks: renormalize with the kernel's log-sum-exp,
    out * Z / (Z + e^s) = out * sigmoid(lse - s). flex propagates gradients through lse."""
    if sinks is not None:
        factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
        out = (out.float() * factor[..., None]).to(dtype)
    return out.transpose(1, 2).contiguous()


# Indirection so tests can check the sink algebra on CPU with a reference flash implementation.
_flash_ops = {
    "forward": lambda *a, **k: torch.ops.aten._flash_attention_forward(*a, **k),
    "backward": lambda *a, **k: torch.ops.aten._flash_attention_backward(*a, **k),
}


def _window_kw(window_left: int) -> dict:
    """Sliding-window kwargs of the aten flash ops, only when a window is used (older torch
    builds may lack them; full causal attention needs none: is_causal=True)."""
    if window_left < 0:
        return {}
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    if "window_size_left" not in schema:
        raise NotImplementedError("this torch's flash varlen op has no sliding window; use "
                                  "packing_backend='flex' for sliding-window models")
    return {"window_size_left": window_left, "window_size_right": 0}


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention-2 varlen with optional exact attention sinks.

    Sinks: y = o * s where s = sigmoid(lse - sink) per (token, head). That is attention over the
    document plus one zero-valued key of score ``sink``. Its exact backward is the flash backward
    called with grad_out = s * dy and out = y (the kernel then subtracts rowsum(grad_out * out) =
    s * (dy . y), the right softmax-Jacobian term), plus d sink = -sum (1 - s) (dy . y).
    torch's varlen_attn ignores the lse gradient, so it cannot do this; we call the aten ops.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len, scale, window_left, split=False):
        res = _flash_ops["forward"](
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **_window_kw(window_left))
        out, lse, rng_a, rng_b = res[0], res[1], res[2], res[3]
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for bf16 inputs
        if sinks is not None:
            s = torch.sigmoid(lse.to(acc) - sinks.to(acc).view(-1, 1)).t().unsqueeze(-1)  # (T, H, 1)
            out = (out.to(acc) * s).to(q.dtype)
        else:
            s = None
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_a, rng_b, s)
        ctx.max_len, ctx.scale, ctx.window_left = max_len, scale, window_left
        ctx.has_sinks = sinks is not None
        ctx.sink_dtype = None if sinks is None else sinks.dtype
        ctx.split = split
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, cu, rng_a, rng_b, s = ctx.saved_tensors
        dy = dy.contiguous()
        kw = {"scale": ctx.scale, **_window_kw(ctx.window_left)}
        if ctx.split:
            dq, dk, dv, dsink = _split_backward(dy, s, q, k, v, y, lse, cu, ctx.max_len, rng_a, rng_b, kw)
        else:
            dq, dk, dv = _flash_ops["backward"](
                _sink_grad_out(dy, s), q, k, v, y, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_a, rng_b, **kw)
            dsink = None if s is None else _sink_grad(dy, y, s)
        if dsink is not None:
            dsink = dsink.to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None, None, None, None, None


def _sink_grad_out(dy, s):
    """The grad_out the flash backward takes where sinks scale the output by s: s * dy."""
    if s is None:
        return dy
    return (dy.to(torch.promote_types(dy.dtype, torch.float32)) * s).to(dy.dtype)


def _sink_grad(dy, y, s):
    """d sink per head (fp32): -sum over tokens of (1 - s) (dy . y)."""
    acc = torch.promote_types(dy.dtype, torch.float32)
    return -((1 - s.squeeze(-1)) * (dy.to(acc) * y.to(acc)).sum(-1)).sum(0)


# FlashAttention-2's backward accumulates dQ in an fp32 buffer the size of every query head and, where
# KV heads are grouped, writes dK and dV for every query head before summing each group, all alive at
# once beside the gradients it returns, at the layer backward's peak (python -m harness.bench.memory
# names the site; harness.bench.attention measures the kernel's peak with and without the split).
# Called one group of heads at a time, those buffers exist for one group. Each call does the same
# arithmetic on its heads as the whole call does on them (a head's dQ, and a KV head's dK and dV summed
# over its query heads); where a call covers part of a KV group, the calls' parts add in fp32.
SPLIT_CALLS = 8  # backward calls per layer: at least this many where the heads allow (fewer heads: one each)


def split_width(heads: int, kv_heads: int) -> int:
    """Query heads per backward call: the widest of at most ``heads / SPLIT_CALLS`` that covers
    whole KV groups or a whole part of one (so each KV head's gradient is one call's or a sum)."""
    group = heads // kv_heads
    best = 1
    for w in range(1, max(1, heads // SPLIT_CALLS) + 1):
        if heads % w == 0 and (w % group == 0 or group % w == 0):
            best = w
    return best


def sdpa_causal_split(q, k, v, scale):
    """``sdpa_causal`` one ``split_width`` group of query heads a call: each call's backward holds
    its group's buffers alone, and the kernel stays SDPA's. (B, H, T, D) in, (B, T, H, D) out. Not
    yet what the switch runs: ``harness.bench.attention`` (backend ``sdpa-causal-split``) measures it
    beside ``sdpa-causal`` and the split varlen first."""
    H, Hk = q.shape[1], k.shape[1]
    group, width = H // Hk, split_width(H, Hk)
    outs = []
    for a in range(0, H, width):
        ks = slice(a // group, a // group + max(1, width // group))
        qh, kh, vh = q[:, a:a + width], k[:, ks], v[:, ks]
        outs.append(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                   enable_gqa=qh.shape[1] != kh.shape[1]))
    return torch.cat(outs, 1).transpose(1, 2).contiguous()


def split_applies(choice: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether switch ``attention_split`` splits the backward: where it is on, on CUDA in fp16/bf16
    where torch has the flash varlen kernel."""
    return choice is True and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) \
        and varlen_available()


def _split_backward(dy, s, q, k, v, y, lse, cu, max_len, rng_a, rng_b, kw):
    """The flash varlen backward over (tokens, heads, dim) inputs, ``split_width`` query heads a
    call (lse is (heads, tokens)); with sinks (s, (tokens, heads, 1)), each call's grad_out and the
    sinks' gradient are made for its heads alone. Returns dq, dk, dv and d sink (None without)."""
    H, Hk = q.shape[1], k.shape[1]
    group, width = H // Hk, split_width(H, Hk)
    partial = width < group  # several calls add into one KV head's gradient: in fp32, rounded once
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.empty_like(q)
    if partial:
        dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    dsink = None if s is None else torch.empty(H, dtype=acc, device=q.device)
    for a in range(0, H, width):
        hs, ks = slice(a, a + width), slice(a // group, a // group + max(1, width // group))
        s_h = None if s is None else s[:, hs]
        dq_h, dk_h, dv_h = _flash_ops["backward"](
            _sink_grad_out(dy[:, hs], s_h).contiguous(), q[:, hs].contiguous(), k[:, ks].contiguous(),
            v[:, ks].contiguous(), y[:, hs].contiguous(), lse[hs].contiguous(), cu, cu, max_len, max_len, 0.0, True,
            rng_a, rng_b, **kw)
        dq[:, hs] = dq_h
        if partial:
            dk[:, ks] += dk_h
            dv[:, ks] += dv_h
        else:
            dk[:, ks], dv[:, ks] = dk_h, dv_h
        if s is not None:
            dsink[hs] = _sink_grad(dy[:, hs], y[:, hs], s_h)
        del dq_h, dk_h, dv_h
    if partial:
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    return dq, dk, dv, dsink


def _public_varlen():
    """torch.nn.attention.varlen.varlen_attn when its signature has what we need (torch >= 2.12:
    window_size and enable_gqa); torch 2.10/2.11 expose fewer arguments, so we use the aten op."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"window_size", "enable_gqa", "scale"} <= set(params) else None


def varlen_available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def _varlen(entry, q, k, v, scale, window, sinks, cache, split=False):
    """FlashAttention-2 varlen; ``split``: its backward a group of heads at a time (``_split_backward``)."""
    B, H, T, D = q.shape
    cu, max_len = cached_structure(entry, ("varlen",), lambda: build_varlen_args(entry), cache)
    qf = q.transpose(1, 2).reshape(B * T, H, D)
    kf = k.transpose(1, 2).reshape(B * T, k.shape[1], D)
    vf = v.transpose(1, 2).reshape(B * T, v.shape[1], D)
    left = -1 if window is None else window - 1  # flash keeps keys with q - k <= left
    KERNEL_CALLS["varlen-split" if split else "varlen"] += 1
    public = None if split else _public_varlen()
    if sinks is None and public is not None:
        out = public(qf, kf, vf, cu, cu, max_len, max_len, scale=scale, window_size=(left, 0),
                     enable_gqa=H != k.shape[1])
    else:
        out = _FlashVarlen.apply(qf, kf, vf, sinks, cu, max_len, scale, left, split)
    return out.view(B, T, H, D)


KERNELS = {"sdpa": _sdpa, "flex": _flex, "varlen": _varlen}


def one_document_per_row(entry) -> bool:
    """Whether every row of the batch is one document (no boundary inside a row): read from host
    values alone (``max_seqlen`` and the shape of ``cu_seqlens``), no sync. An entry built on the
    device from position_ids (a CUDA-graph capture) has no host lengths: False."""
    cu = entry.cu_seqlens
    return cu is not None and entry.max_seqlen == entry.T and cu.numel() == entry.B + 1


def causal_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Where ``sdpa_causal`` may stand in for the packed kernels: on CUDA in fp16/bf16 with a head
    dim flash takes (elsewhere SDPA with grouped KV heads falls back to the math kernel, which holds
    B x H x T x T scores, where flex and varlen hold none); on the CPU, whose packed kernel is the
    masked SDPA. Never between ``optim.graphs``' warm-up and capture: the capture reads boundaries
    from position_ids on the device, with no host lengths to tell whole rows, so the warm-up must
    take the kernel the capture takes."""
    if CAPTURE_PATHS["depth"]:
        return False
    if device.type == "cuda":
        return dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
    return True


def sdpa_causal(q, k, v, scale):
    """Rows of one document each: plain causal SDPA, no mask (stock's kernel for such a row).
    (B, H, T, D) in, (B, T, H, D) out. Traceable: compiled layers run it inside their graph."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


# What ``packing_backend = "auto"`` picks on CUDA, by whether optim.regional compiles the decoder
# layers. The rows that back each choice are in results/ (H100 and H200, bf16, LoRA, packed
# documents, one process per point) and reports/packing and reports/user set them side by side.
# Before this table, ``auto`` runs ``sdpa_causal`` on any batch whose rows are one document each
# (on models without attention sinks or sliding windows, where ``causal_applies``): no boundary to
# keep, and causal SDPA beat flex and varlen at every length the ``attention_kernel`` rows of
# results/packing/ measured, 4096 to 131072 tokens with Llama-3.1-8B's heads in bf16 on the H100
# (``python -m harness.bench.attention``; reports/packing, "Attention kernels").
AUTO_ON_CUDA = {
    # Compiled layers: flex is traced into the layer's graph (its BlockMasks prebuilt outside), so
    # one graph serves every layer and batch; varlen and sdpa stay eager behind a graph break.
    # Rows: packing/ (packed-flex-compiled against packed-varlen-compiled), user/ and user-moe/
    # (optim.enable's defaults, "user", against "user-varlen"), dense, gpt-oss and Qwen3-MoE.
    True: "flex",
    # Eager layers: FlashAttention-2 varlen needs no mask, only cu_seqlens. Rows: packing/
    # (packed-varlen against packed-flex, eager layers).
    False: "varlen",
}


def resolve_backend(choice: str, device: torch.device, dtype: torch.dtype, *, compiled: bool = False) -> str:
    """The kernel a ``packing_backend`` choice runs: ``auto`` reads ``AUTO_ON_CUDA`` on CUDA (varlen
    only in fp16/bf16 and where torch has the flash kernel, else flex), and is sdpa on CPU (flex has
    no CPU backward, varlen no CPU kernel)."""
    if choice != "auto":
        return choice
    if device.type == "cuda":
        pick = AUTO_ON_CUDA[bool(compiled)]
        if pick == "varlen" and not (dtype in (torch.float16, torch.bfloat16) and varlen_available()):
            return "flex"
        return pick
    return "sdpa"
