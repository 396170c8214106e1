"""What a point's row records beside its step times: throughput, device memory, FLOPs and MFU,
what each optim module reports, which attention kernels ran, and the ranks' figures gathered
onto rank 0 for a parallel point."""

from __future__ import annotations

import importlib

import torch

from harness.measure import env as envmod
from harness.measure import flops as flopsmod
from harness.measure.timing import percentiles
from harness.run import distributed
from harness.run.experiment import SweepPoint


def across_ranks(world: distributed.World, mine: dict, warmup_losses: list[float]) -> dict:
    """A parallel point's figures over its ranks (a collective): each rank's own in ``per_rank``;
    the row's step times are rank 0's (every step ends in collectives, so the ranks keep pace),
    its tokens/s those of the whole group, its peak memory the largest rank's."""
    ranks = distributed.gather({
        "rank": world.rank,
        **{k: mine[k]["p50"] for k in ("step_ms", "forward_ms", "backward_ms", "optimizer_ms")},
        "peak_allocated_gib": mine["peak_allocated_gib"],
        "collective_ms": mine["collective_ms"],
        "pinned_core": mine["pinned_core"],
        "loss": mine["loss"],
        "loss_warmup": warmup_losses,
    })
    peaks = [r["peak_allocated_gib"] for r in ranks if r["peak_allocated_gib"] is not None]
    return {
        "world_size": world.size,
        "per_rank": ranks,
        "tokens_per_s_per_gpu": mine["tokens_per_s"],
        "tokens_per_s": mine["tokens_per_s"] * world.size,
        "peak_allocated_gib": max(peaks) if peaks else None,
        # the loss of each global batch: the mean of the ranks' (each rank's is its own rows' mean)
        "loss_global": [sum(r["loss"][j] for r in ranks) / world.size for j in range(len(mine["loss"]))],
        # the same for the warm-up steps, the first included: parity from step one
        "loss_global_warmup": [sum(r["loss_warmup"][j] for r in ranks) / world.size
                               for j in range(len(warmup_losses))],
    }


def optim_stats(model, optim_applied: dict) -> dict:
    """What the optimizations did during the run: each applied module's ``run_stats`` (offload's
    buffer use, packing's structure builds, regional's layer calls), and the attention kernels."""
    out = {}
    for name in optim_applied:
        run_stats = getattr(importlib.import_module(name), "run_stats", None)
        if run_stats is not None:
            out.update(run_stats(model))
    out.update(attention_kernels(model, optim_applied))
    return out


def optim_after(model, optim_applied: dict) -> dict:
    """``optim.enabled(model)`` read after the run: each applied module's description with its
    counters over every step (chunked MLP calls, recomputes, compiled layer calls), which at
    enable time are all 0; ``optim_applied`` itself where no module was applied."""
    if not optim_applied:
        return optim_applied
    import optim

    return optim.enabled(model)


def attention_kernels(model, optim_applied: dict) -> dict:
    """Which attention kernels ran, not which were asked for: ``attention_kernels`` maps each to
    its calls since ``optim.packing.reset_counters()`` (None where only its use is known), and
    ``attention_fallback`` says why optim.packing's fused flex could not run (None if it could).

    Kernels: ``flex-fused``, ``flex-unfused``, ``varlen``, ``sdpa-mask``, ``sdpa-causal``
    (optim.packing's eager path), ``flex-fused-traced`` and ``sdpa-causal-traced`` (traced into
    optim.regional's compiled layers, each where a batch ran it), and for a
    stock model its attention implementation (``stock-<name>``); ``flex-unfused`` also when torch
    warned that flex_attention ran uncompiled anywhere in this process (stock flex included)."""
    from torch.nn.attention import flex_attention as torch_flex

    ran: dict = {}
    fallback = None
    if "optim.packing" in optim_applied:
        from optim import packing

        ran.update(packing.kernels())
        fallback = packing.fused_flex_failure()
    if "optim.regional" in optim_applied:
        from optim import regional

        d = regional.describe(model)
        if d.get("flex_traced") and d.get("layer_calls", {}).get("compiled"):
            from optim import packing

            batches = packing.counters()  # inside the compiled graph: no per-call count, batches only
            if batches.get("flex_batches"):  # batches whose BlockMasks the stack's pre-hook built
                ran["flex-fused-traced"] = None
            if batches.get("causal_batches"):
                ran["sdpa-causal-traced"] = None
    if not ran:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl is not None:
            ran[f"stock-{impl}"] = None
    if "flex_attention_performance" in getattr(torch_flex, "_WARNINGS_SHOWN", ()):
        ran.setdefault("flex-unfused", None)
    return {"attention_kernels": ran, "attention_fallback": fallback}


def throughput(point: SweepPoint, times: dict) -> dict:
    step_s = percentiles(times["step"])["p50"] / 1e3
    return {
        "steps_per_s": 1.0 / step_s,
        "tokens_per_s": point.batch_size * point.seq_len / step_s,
    }


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None,
                "nvml_device_used_gib": None, "nvml_process_gib": None}
    used, mine = envmod.nvml_memory_gib(torch.cuda.current_device())
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "nvml_device_used_gib": used,
        "nvml_process_gib": mine,
    }


def recomputed_share(point, model) -> float:
    """The share of decoder layers whose forward checkpointing ran again in the last step: none
    without checkpointing, all with it, less the layers optim.recompute let skip."""
    if not point.switches["gradient_checkpointing"]:
        return 0.0
    from optim import recompute

    st = recompute.describe(model)
    layers, skipped = st.get("layers"), (st.get("layers_skipped") or {}).get("last", 0)
    return 1.0 - skipped / layers if layers else 1.0


def flops(point, spec, model, measured, times, device) -> dict:
    frozen, adapter = flopsmod.matmul_params(model, spec.num_experts, spec.experts_per_token)
    head = flopsmod.head_params(model)
    share = recomputed_share(point, model)
    windows = flopsmod.layer_windows(spec.config())
    per_step = [
        flopsmod.step_flops(
            tokens=b.sum_len, frozen_params=frozen, adapter_params=adapter,
            doc_lengths=[l for r in b.lengths for l in r], layer_windows=windows,
            num_heads=spec.num_attention_heads, head_dim=spec.head_dim,
            recompute=share, head_params=head,
        )
        for b in measured
    ]
    model_flops = sum(f.model_flops for f in per_step) / len(per_step)
    hw_flops = sum(f.hardware_flops for f in per_step) / len(per_step)
    out = {"model_flops_per_step": model_flops, "hardware_flops_per_step": hw_flops,
           "flops_per_step": model_flops, "mfu": None, "hfu": None, "mfu_note": "",
           "flops_version": flopsmod.FLOPS_VERSION}
    if device.type != "cuda":
        out["mfu_note"] = "no GPU peak on CPU"
        return out
    name = torch.cuda.get_device_name(device)
    peak = flopsmod.peak_flops(name)
    if peak is None:
        out["mfu_note"] = f"unknown bf16 peak for {name!r}; add it to harness/measure/flops.py"
        return out
    step_s = percentiles(times["step"])["p50"] / 1e3
    out["mfu"] = model_flops / step_s / peak
    out["hfu"] = hw_flops / step_s / peak
    out["peak_flops"] = peak
    return out
