"""Packing measurements that are not plain step timing.

(a) ``count_step``: structure builds and device-to-host syncs in one training step, cache on vs
    off, counted (optim.packing counters; on CUDA every sync is also caught with
    ``torch.cuda.set_sync_debug_mode("warn")`` and attributed to optim.packing or the rest).
    Counts depend on the layer count, layer types and checkpointing, not on the width, so they
    are taken on a width-reduced twin of the model with its real number of layers.
(b) ``measure_m``: m, the cost of one metadata-plus-structure build, per backend and packed
    length (CUDA events, warm-up, median with p20/p80).
(c) ``rows``: result rows (``kind`` = "packing_m" / "packing_counts") with the predicted saving
    (builds_off - builds_on) * m and the published (L - 1) * m beside it. The measured saving comes
    from the sweep's step times (experiments/packing.toml); the report divides the two.

    python -m harness.bench.packing [--lengths 2048 8192 16384]
        [--models llama-3.2-1b qwen3-0.6b qwen3-14b] [--backends sdpa flex varlen]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import torch

import optim.packing as P
from optim._syncs import is_sync_warning
from harness.bench import add_store_arguments, store
from harness.measure.timing import percentiles
from harness.run.experiment import DataSpec
from harness.workload import models as registry
from harness.workload.data import make_batch

DEFAULT_MODELS = ["llama-3.2-1b", "qwen3-0.6b", "qwen3-14b"]
DEFAULT_LENGTHS = [2048, 8192, 16384]
# ~50 ms of a spin kernel at H100/H200 clocks: longer than the host takes to issue any build
SPIN_CYCLES = 100_000_000


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _backends(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["sdpa", "flex"] + (["varlen"] if P.varlen_available() else [])
    return ["sdpa"]  # flex has no CPU backward, varlen no CPU kernel


def count_twin(name: str) -> registry.ModelSpec:
    """The model's tiny twin with its real layer count and layer types (same counts, cheap)."""
    real, tiny = registry.get(name), registry.get(f"{name}-tiny" if not name.endswith("-tiny") else name)
    extra = dict(tiny.extra)
    if "layer_types" in real.extra:
        extra["layer_types"] = real.extra["layer_types"]
    return dataclasses.replace(tiny, num_hidden_layers=real.num_hidden_layers, extra=extra)


def count_step(name: str, seq_len: int, backend: str, cache: bool, *, data: DataSpec | None = None,
               with_metadata: bool = True, device: torch.device | None = None) -> dict:
    """Builds and syncs in one training step (forward + checkpointed backward), after a warm-up
    step. ``with_metadata=False`` hands only position_ids to the model (the stock collator case)."""
    device = device or _device()
    spec = count_twin(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = registry.build(spec, device=device, dtype=dtype, lora_rank=4, gradient_checkpointing=True)
    P.enable(model, packing_backend=backend, packing_cache=cache)
    batch = make_batch(data or DataSpec(), seq_len, 1, spec.vocab_size).to(device)
    meta = P.PackedMetadata.from_lengths(batch.lengths)
    kw = P.packed_kwargs(meta) if with_metadata else {}

    def step():
        out = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                    use_cache=False, **kw)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (flex compiles here)
    P.release()
    if device.type == "cuda":
        torch.cuda.synchronize()
    P.reset_counters()
    syncs_total = syncs_packing = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if is_sync_warning(w):
            syncs_total += 1
            syncs_packing += "optim/packing" in (w.filename or "")
    c = P.counters()
    builds = {k: c.get(k, 0) for k in ("metadata", "sdpa_mask", "flex_block_mask", "varlen_args")}
    structure = {"sdpa": "sdpa_mask", "flex": "flex_block_mask", "varlen": "varlen_args"}[backend]
    return {
        "model": name, "seq_len": seq_len, "backend": backend, "cache": cache,
        "with_metadata": with_metadata, "num_layers": spec.num_hidden_layers,
        "num_docs": batch.num_docs, "builds": builds,
        # one "build" = metadata + the backend's structure (what m times)
        "structure_builds": builds[structure], "metadata_builds": builds["metadata"],
        "cache_hits": c.get("cache_hits", 0),
        "packing_host_syncs": c.get("host_syncs", 0) if device.type == "cuda" else None,
        "syncs_in_packing_code": syncs_packing if device.type == "cuda" else None,
        "syncs_in_step": syncs_total if device.type == "cuda" else None,
        "device_type": device.type,
    }


def measure_m(backend: str, seq_len: int, *, window: int | None = None, sinks: bool = False,
              data: DataSpec | None = None, warmup: int = 3, repeats: int = 20,
              from_position_ids: bool = False, device: torch.device | None = None) -> dict:
    """m: one metadata + structure build for a fresh batch of ``seq_len`` packed tokens."""
    device = device or _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = make_batch(data or DataSpec(), seq_len, 1, 512)
    pos = batch.position_ids.to(device)
    meta = P.PackedMetadata.from_lengths(batch.lengths)
    build_structure = {
        "sdpa": lambda e: P.build_sdpa_mask(e, window, dtype, int(sinks)),
        "flex": lambda e: P.build_flex_block_mask(e, window),
        "varlen": lambda e: P.build_varlen_args(e),
    }[backend]

    def once(i):
        m = P.PackedMetadata.from_position_ids(pos) if from_position_ids else meta
        entry = P.build_entry(("bench", i), m, device)
        return build_structure(entry)

    samples, host, dev = [], [], []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            # "host" (m_host_ms): the build end to end on an idle GPU, from issuing it to its last
            # kernel's end: the host's time, plus any device time the host did not cover
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = once(i)
            torch.cuda.synchronize()
            host_ms = (time.perf_counter() - t0) * 1e3
            del out
            # device: the build's kernels alone. A spin kernel keeps the GPU busy while the host
            # issues them, so the events do not count the host's gaps between launches (on an
            # idle GPU they would: the span would be the host time again). A sync inside the
            # build waits for the spin, and the gaps after it count, as they do in a step.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            out = once(warmup + repeats + i)
            end.record()
            torch.cuda.synchronize()
            dev_ms = start.elapsed_time(end)
            # the build costs a step the larger of the two when nothing overlaps it (an idle GPU)
            ms = max(dev_ms, host_ms)
        else:
            t0 = time.perf_counter()
            out = once(i)
            ms = host_ms = (time.perf_counter() - t0) * 1e3
            dev_ms = None
        del out
        if i >= warmup:
            samples.append(ms)
            host.append(host_ms)
            dev.append(dev_ms)
    p = percentiles(samples)
    # In a GPU-bound step the host part overlaps kernels already queued; what a rebuild must
    # still add there is bounded below by its device time. Both are kept so the report can say.
    out = {"backend": backend, "seq_len": seq_len, "window": window, "sinks": sinks,
           "from_position_ids": from_position_ids, "m_ms": p["p50"], "m_p20_ms": p["p20"],
           "m_p80_ms": p["p80"], "m_samples_ms": p["samples"], "device_type": device.type,
           "num_docs": batch.num_docs, "m_host_ms": percentiles(host)["p50"], "m_device_ms": None}
    if device.type == "cuda":
        out["m_device_ms"] = percentiles(dev)["p50"]
    return out


def rows(m_results: list[dict], count_results: list[dict]) -> list[dict]:
    """Result rows for the harness: one "packing_m" per m, one "packing_counts" per (model,
    length, backend) pairing cache on with off, with the predicted savings."""
    out = [{"kind": "packing_m", **m} for m in m_results]
    m_of = {(m["backend"], m["seq_len"], m["from_position_ids"]): m["m_ms"] for m in m_results
            if m["window"] is None and not m["sinks"]}
    by_key = {(c["model"], c["seq_len"], c["backend"], c["with_metadata"], c["cache"]): c
              for c in count_results}
    for (model, T, backend, with_meta, cache), on in by_key.items():
        if not cache:
            continue
        off = by_key.get((model, T, backend, with_meta, False))
        m = m_of.get((backend, T, not with_meta))
        row = {"kind": "packing_counts", "model": model, "seq_len": T, "backend": backend,
               "with_metadata": with_meta, "num_layers": on["num_layers"], "cache_on": on,
               "cache_off": off, "m_ms": m}
        if off is not None:
            row["builds_on"], row["builds_off"] = on["structure_builds"], off["structure_builds"]
            row["predicted_saving_ms"] = None if m is None else (off["structure_builds"] - on["structure_builds"]) * m
            row["seeds_prediction_ms"] = None if m is None else (on["num_layers"] - 1) * m
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.packing", description=__doc__.split("\n\n")[0])
    add_store_arguments(ap, "packing")
    ap.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--backends", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--median-doc-len", type=int, default=DataSpec.median_doc_len)
    ap.add_argument("--m-only", action="store_true", help="measure m alone, without counting builds "
                    "and syncs in a training step (no model is built)")
    args = ap.parse_args(argv)
    device = _device()
    backends = args.backends or _backends(device)
    data = DataSpec(median_doc_len=args.median_doc_len)
    m_results, counts = [], []
    for T in args.lengths:
        for b in backends:
            m_results.append(measure_m(b, T, data=data, repeats=args.repeats, device=device))
            m_results.append(measure_m(b, T, data=data, repeats=args.repeats, device=device,
                                       from_position_ids=True))
            print(f"m  {b:7s} T={T:6d}  {m_results[-2]['m_ms']:8.3f} ms (from lengths)  "
                  f"{m_results[-1]['m_ms']:8.3f} ms (from position_ids)", flush=True)
    for name in [] if args.m_only else args.models:
        for T in args.lengths:
            for b in backends:
                for with_meta in (True, False):
                    for cache in (True, False):
                        counts.append(count_step(name, T, b, cache, data=data, with_metadata=with_meta,
                                                 device=device))
    result = rows(m_results, counts)
    from harness.measure import env as envmod

    path = store(args, result, envmod.collect(), "harness.bench.packing", argv)
    print(f"\n{'model':14s} {'T':>6s} {'backend':7s} {'meta':5s} {'L':>3s} {'on':>4s} {'off':>4s} "
          f"{'syncs on/off':>13s} {'m ms':>8s} {'pred ms':>9s} {'(L-1)m':>9s}")
    for r in result:
        if r["kind"] != "packing_counts" or r.get("cache_off") is None:
            continue
        s_on, s_off = r["cache_on"]["packing_host_syncs"], r["cache_off"]["packing_host_syncs"]
        fmt = lambda x: "-" if x is None else f"{x:9.2f}"  # noqa: E731
        print(f"{r['model']:14s} {r['seq_len']:6d} {r['backend']:7s} {str(r['with_metadata']):5s} "
              f"{r['num_layers']:3d} {r['builds_on']:4d} {r['builds_off']:4d} {str(s_on) + '/' + str(s_off):>13s} "
              f"{fmt(r['m_ms'])[1:]:>8s} {fmt(r['predicted_saving_ms'])} {fmt(r['seeds_prediction_ms'])}")
    print(f"\nstored {len(result)} rows in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
