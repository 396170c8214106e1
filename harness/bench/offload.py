"""Offloaded checkpointing side by side: none / single / double / save_on_cpu, in one process.

    python -m harness.bench.offload --model qwen3-8b \
        --seq-len 2048 --seq-len 8192                      # batch sized to ~256 MiB per layer input
    python -m harness.bench.offload --results /tmp/r --model llama-3.2-1b-tiny --device cpu \
        --dtype fp32 --seq-len 64 --batch-size 2 --steps 2 --warmup 1 --no-trace   # CPU smoke

For each (model, seq_len, batch) the model is built once; each mode is then enabled in turn with
``optim.offload.enable`` and timed over ``--warmup`` + ``--steps`` full training steps (forward,
backward, AdamW), CUDA events, median and p20/p80, peak VRAM after the warm-up.

Rows (``kind``):
- ``offload``: one per mode: step_ms {p20,p50,p80,samples}, steps_per_s, peak_allocated_gib,
  peak_reserved_gib, the offloader's stats (layers offloaded, bytes, buffers, fallbacks), losses.
- ``offload_summary``: one per point: c (per-layer reload, event-timed in ``single`` where the copy
  runs alone) beside bytes / measured pinned bandwidth; g (per-layer recompute + backward); the
  predicted saving (n−1)·min(c, g) for the n reloaded layers against the measured single − double
  with their ratio; double's speed-up over single and none and save_on_cpu; the extra VRAM of the
  second buffer (peak double − peak single, and its size); VRAM saved against none; and from a
  torch.profiler trace of one double step, the H2D copies' overlap with kernels of other streams
  (``overlap_stats``) and whether they were pinned.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch

from harness.bench import add_store_arguments, store
from harness.measure import env as envmod
from harness.measure.timing import percentiles
from harness.measure.trace import covered, trace_events, union
from harness.run.experiment import DataSpec
from harness.variant_keys import SWITCHES
from harness.workload import models as model_registry
from harness.workload.data import make_batch
from harness.workload.loss import causal_lm_loss

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = SWITCHES["offload"].choices


# ---------------------------------------------------------------------------------------------
# Trace analysis (also used by tests/test_gpu_offload.py)
# ---------------------------------------------------------------------------------------------


def overlap_stats(events: list[dict]) -> dict:
    """Host-to-device copies in a chrome trace (torch.profiler's ``traceEvents``): how much of
    their time runs while a kernel of another stream runs, on which streams, pinned or pageable."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    h2d = [e for e in xs if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    stream = lambda e: (e.get("args") or {}).get("stream")  # noqa: E731
    by_stream: dict = {}
    for k in kernels:
        by_stream[stream(k)] = by_stream.get(stream(k), 0.0) + float(k["dur"])
    main = max(by_stream, key=by_stream.get) if by_stream else None  # the compute stream
    total = overlapped = 0.0
    for c in h2d:
        a, b = float(c["ts"]), float(c["ts"]) + float(c["dur"])
        others = union([(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels
                         if stream(k) != stream(c)])
        total += b - a
        overlapped += covered(a, b, others)
    return {
        "h2d_count": len(h2d),
        "h2d_us": total,
        "h2d_overlapped_us": overlapped,
        "overlap_pct": 100.0 * overlapped / total if total else None,
        "h2d_streams": sorted({stream(c) for c in h2d}, key=str),
        "compute_streams": sorted(by_stream, key=str),
        "main_compute_stream": main,
        "h2d_on_side_stream": sum(stream(c) != main for c in h2d),
        "h2d_pinned": sum("Pinned" in c["name"] for c in h2d),
        "h2d_pageable": sum("Pageable" in c["name"] for c in h2d),
    }


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _steps(model, optimizer, batches, device, chunk_tokens: int | None = None) -> tuple[list[float], list[float]]:
    """Full training steps; step ms (CUDA events read once at the end) and losses."""
    import time

    marks, losses = [], []
    for b in batches:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        marks.append(ev)
        loss = causal_lm_loss(model, b.input_ids, b.labels, chunked=bool(chunk_tokens),
                              chunk_tokens=chunk_tokens or 0, position_ids=b.position_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        marks.append(end)
        ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        marks.append(time.perf_counter())
        ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    return ms, torch.stack(losses).float().cpu().tolist()


def _reset(model, device):
    import optim.offload as oo

    off = oo.get(model)
    if off is not None:
        off.close()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_mode(model, optimizer, batches, warmup, mode, device, *, min_bytes, profile=False,
             chunk_tokens=None) -> dict:
    import optim.offload as oo

    _reset(model, device)
    oo.enable(model, offload=mode, min_bytes=min_bytes, profile=profile)
    off = oo.get(model)
    row = {"kind": "offload", "mode": mode, "profile": profile}
    try:
        _steps(model, optimizer, batches[:warmup], device, chunk_tokens)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms, losses = _steps(model, optimizer, batches[warmup:], device, chunk_tokens)
    except torch.OutOfMemoryError as e:
        optimizer.zero_grad(set_to_none=True)
        row.update(status="oom", message=str(e).splitlines()[0][:300])
        return row
    st = off.stats()
    p = percentiles(ms)
    row.update(
        status="ok", message="", step_ms=p, steps_per_s=1e3 / p["p50"], loss=losses,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
        offload_stats=st,
    )
    return row


def _pinned_gbps(nbytes: int) -> float | None:
    try:
        from harness.measure.bandwidth import measure_h2d

        row = next(r for r in measure_h2d(sizes=[nbytes], repeats=5) if r["memory"] == "pinned")
        return row["gbps"]["p50"]
    except Exception:  # noqa: BLE001 - no GPU, or no NVML: the prediction column stays empty
        return None


def _profile_trace(model, optimizer, batch, device, min_bytes, chunk_tokens=None) -> dict:
    """One double step under torch.profiler (after a warm-up step): copy/compute overlap."""
    from torch.profiler import ProfilerActivity, profile

    import optim.offload as oo

    _reset(model, device)
    oo.enable(model, offload="double", min_bytes=min_bytes)
    _steps(model, optimizer, [batch], device, chunk_tokens)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _steps(model, optimizer, [batch], device, chunk_tokens)
    return overlap_stats(trace_events(prof))


def _med(xs):
    return statistics.median(xs) if xs else None


def summarize(rows: dict, *, layer_bytes: int, gbps: float | None, trace: dict | None) -> dict:
    def p50(mode):
        r = rows.get(mode)
        return r["step_ms"]["p50"] if r and r.get("status") == "ok" else None

    def peak(mode):
        r = rows.get(mode)
        return r.get("peak_allocated_gib") if r and r.get("status") == "ok" else None

    prof = rows.get("single_profile", {}).get("offload_stats", {})
    c, g = _med(prof.get("reload_ms", [])), _med(prof.get("backward_ms", []))
    dprof = rows.get("double_profile", {}).get("offload_stats", {})
    n = (rows.get("double") or {}).get("offload_stats", {}).get("offloaded") or prof.get("offloaded") or 0
    pred = (n - 1) * min(c, g) if c is not None and g is not None and n else None
    s, d, z, soc = p50("single"), p50("double"), p50("none"), p50("save_on_cpu")
    meas = s - d if s is not None and d is not None else None
    dst = (rows.get("double") or {}).get("offload_stats", {})
    return {
        "kind": "offload_summary",
        "layer_input_bytes": layer_bytes,
        "layers_reloaded": n,
        "c_ms": c,
        "c_ms_double": _med(dprof.get("reload_ms", [])),  # the copies while compute runs beside
        "pinned_gbps": gbps,
        "c_pred_ms": layer_bytes / (gbps * 1e9) * 1e3 if gbps else None,
        "g_ms": g,
        "g_ms_double": _med(dprof.get("backward_ms", [])),
        "predicted_saving_ms": pred,
        "measured_saving_ms": meas,
        "saving_ratio": meas / pred if meas is not None and pred else None,
        "double_over_single_pct": 100 * (s / d - 1) if s and d else None,
        # what the model allows: T_single − (n−1)·min(c, g); bounded by min(c,g)/(c+g) per layer
        "predicted_double_over_single_pct": 100 * (s / (s - pred) - 1) if s and pred else None,
        "double_vs_none_step_pct": 100 * (d / z - 1) if z and d else None,
        "double_over_save_on_cpu_pct": 100 * (soc / d - 1) if soc and d else None,
        "second_buffer_gib": (dst.get("staging_buffer_bytes") or [0, 0])[1] / 2**30,
        "second_buffer_peak_gib": peak("double") - peak("single")
        if peak("double") is not None and peak("single") is not None else None,
        "vram_saved_vs_none_gib": peak("none") - peak("double")
        if peak("none") is not None and peak("double") is not None else None,
        "effective_double_mode": dst.get("effective_mode"),
        "trace": trace,
    }


def bench_point(spec, seq_len, batch_size, args, device, dtype, gbps: float | None = None) -> list[dict]:
    model = model_registry.build(spec, device=device, dtype=dtype, attn_implementation=args.attn,
                                 lora_rank=args.lora_rank, gradient_checkpointing=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    data = DataSpec(distribution="fixed", median_doc_len=min(args.doc_len, seq_len), seed=0)
    n = args.warmup + args.steps
    batches = [make_batch(data, seq_len, batch_size, spec.vocab_size, step=i).to(device)
               for i in range(n)]
    layer_bytes = batch_size * seq_len * spec.hidden_size * torch.tensor([], dtype=dtype).element_size()
    base = {"model": spec.name, "num_layers": spec.num_hidden_layers, "seq_len": seq_len,
            "batch_size": batch_size, "dtype": args.dtype, "attn": args.attn,
            "lora_rank": args.lora_rank, "warmup_steps": args.warmup, "measured_steps": args.steps,
            "layer_input_bytes": layer_bytes, "device_type": device.type}
    chunk = args.loss_chunk if args.loss == "chunked" else None
    base["loss_mode"] = "chunked" if chunk else "full"
    rows: dict[str, dict] = {}
    for r in range(args.rounds):  # modes interleaved per round, so drift hits them alike
        for mode in args.modes:
            row = run_mode(model, optimizer, batches, args.warmup, mode, device,
                           min_bytes=args.min_bytes, chunk_tokens=chunk)
            if mode in rows and rows[mode].get("status") == "ok" and row.get("status") == "ok":
                samples = rows[mode]["step_ms"]["samples"] + row["step_ms"]["samples"]
                row["step_ms"] = percentiles(samples)
                row["steps_per_s"] = 1e3 / row["step_ms"]["p50"]
                row["loss"] = rows[mode]["loss"] + row["loss"]
            rows[mode] = row
            print(f"  {spec.name} T={seq_len} B={batch_size} {mode:12s} round {r}: "
                  f"{row.get('step_ms', {}).get('p50')} ms {row['status']}", file=sys.stderr)
    # c and g from event-timed runs (events only, read at the end): single = copy alone
    for mode in ("single", "double"):
        if mode in args.modes:
            # c and g come per layer (n samples per step): one measured step is enough
            rows[f"{mode}_profile"] = run_mode(model, optimizer, batches[:args.warmup + args.profile_steps],
                                               args.warmup, mode, device, min_bytes=args.min_bytes,
                                               profile=True, chunk_tokens=chunk)
    trace = None
    if args.trace and device.type == "cuda" and "double" in args.modes:
        trace = _profile_trace(model, optimizer, batches[0], device, args.min_bytes, chunk)
    _reset(model, device)
    out = [{**base, **row, "mode": row["mode"] if not k.endswith("_profile") else k}
           for k, row in rows.items()]
    out.append({**base, **summarize(rows, layer_bytes=layer_bytes, gbps=gbps, trace=trace)})
    del model, optimizer, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def auto_batch(spec, seq_len: int, target_bytes: int, elem: int = 2) -> int:
    """The batch giving a layer input closest to ``target_bytes`` (at least 1)."""
    return max(1, round(target_bytes / (seq_len * spec.hidden_size * elem)))


def _fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def print_table(rows: list[dict]) -> None:
    print(f"{'model':16s} {'T':>5s} {'B':>3s} {'MiB/layer':>9s} {'mode':12s} {'ms p50':>9s} "
          f"{'steps/s':>8s} {'peak GiB':>8s} {'fallbacks'}")
    for r in rows:
        if r["kind"] == "offload" and not r["mode"].endswith("_profile"):
            st = r.get("offload_stats") or {}
            print(f"{r['model']:16s} {r['seq_len']:5d} {r['batch_size']:3d} "
                  f"{(r.get('layer_input_bytes') or 0) / 2**20:9.0f} {r['mode']:12s} "
                  f"{_fmt((r.get('step_ms') or {}).get('p50'))!s:>9s} {_fmt(r.get('steps_per_s'), 4):>8s} "
                  f"{_fmt(r.get('peak_allocated_gib'), 2):>8s} {len(st.get('fallbacks', [])) or r['status']}")
        elif r["kind"] == "offload_summary":
            tr = r.get("trace") or {}
            print(f"  c={_fmt(r['c_ms'], 2)} ms (bytes/bw {_fmt(r['c_pred_ms'], 2)} ms @ "
                  f"{_fmt(r['pinned_gbps'])} GB/s)  g={_fmt(r['g_ms'], 2)} ms  n={r['layers_reloaded']}  "
                  f"saving pred {_fmt(r['predicted_saving_ms'])} / meas {_fmt(r['measured_saving_ms'])} ms "
                  f"(ratio {_fmt(r['saving_ratio'], 2)})  double/single {_fmt(r['double_over_single_pct'])} %  "
                  f"double vs none {_fmt(r['double_vs_none_step_pct'])} %  "
                  f"vs save_on_cpu {_fmt(r['double_over_save_on_cpu_pct'])} %  "
                  f"2nd buf {_fmt(r['second_buffer_gib'], 3)} GiB (peak +{_fmt(r['second_buffer_peak_gib'], 3)})  "
                  f"saved vs none {_fmt(r['vram_saved_vs_none_gib'], 2)} GiB  "
                  f"overlap {_fmt(tr.get('overlap_pct'))} % pinned {tr.get('h2d_pinned')}/{tr.get('h2d_count')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.offload", description=__doc__.split("\n")[0])
    add_store_arguments(ap, "offload")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--seq-len", type=int, action="append", required=True)
    ap.add_argument("--batch-size", action="append", default=None,
                    help="one per --seq-len (or one for all), or 'auto' (default): ~--target-mib per layer input")
    ap.add_argument("--target-mib", type=float, default=256.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="cycle the modes this many times")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="measured steps of the event-timed single/double runs that give c and g")
    ap.add_argument("--loss", choices=("chunked", "full"), default="chunked",
                    help="chunked (default): lm_head + cross-entropy in checkpointed token chunks "
                         "(harness.workload.loss), so the fp32 logits of a large vocabulary do not set the "
                         "peak and hide what offloading saves; full: the model's own loss")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="tokens per loss chunk")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--doc-len", type=int, default=1024, help="fixed packed document length")
    ap.add_argument("--min-bytes", type=int, default=1 << 20)
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA GPU is visible")
    dtype = DTYPES[args.dtype]
    bs = args.batch_size or ["auto"]
    if len(bs) == 1:
        bs = bs * len(args.seq_len)
    if len(bs) != len(args.seq_len):
        ap.error("give one --batch-size per --seq-len, or one for all")
    rows: list[dict] = []
    env = envmod.collect()
    elem = torch.tensor([], dtype=dtype).element_size()
    points = []
    for name in args.model:
        spec = model_registry.get(name)
        for seq_len, b in zip(args.seq_len, bs):
            batch = auto_batch(spec, seq_len, int(args.target_mib * 2**20), elem) if b == "auto" else int(b)
            points.append((spec, seq_len, batch, batch * seq_len * spec.hidden_size * elem))
    # The pinned bandwidth for each layer-input size, measured before any model exists: measured
    # after a run (host pools just released, the GPU full) it came out at half the copy speed
    # the offloader itself reached (29 vs 55 GB/s on the H100).
    gbps = {n: _pinned_gbps(n) for n in sorted({p[3] for p in points})} if device.type == "cuda" else {}
    for spec, seq_len, batch, layer_bytes in points:
        try:
            rows += bench_point(spec, seq_len, batch, args, device, dtype, gbps.get(layer_bytes))
        except torch.OutOfMemoryError as e:  # the model alone does not fit: a row, not a crash
            rows.append({"kind": "offload", "model": spec.name, "seq_len": seq_len,
                         "batch_size": batch, "mode": "build", "status": "oom",
                         "message": str(e).splitlines()[0][:300]})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # stored after every point, so a later crash keeps what was measured
        path = store(args, rows, env, "harness.bench.offload", argv)
    print_table(rows)
    print(f"rows in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
