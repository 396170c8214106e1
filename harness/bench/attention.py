"""The packed attention kernels side by side, one process: what each costs per layer call.

For one attention geometry (a model's heads, KV heads and head dim) and rows of ``seq_len`` tokens
made of documents of ``doc_len`` (one document where ``doc_len`` is the row), each kernel runs the
forward alone and the forward plus backward, timed with CUDA events after a warm-up; medians with
the p20-p80 spread. The kernels are ``optim.packing``'s own, called as its layers call them:

- ``flex``: flex_attention's fused kernel on the batch's document BlockMask (what ``auto`` runs in
  compiled layers, traced into the layer's graph);
- ``varlen``: FlashAttention-2 varlen on ``cu_seqlens`` (what ``auto`` runs in eager layers);
- ``varlen-split``: the same, its backward one group of query heads at a time (switch
  ``attention_split``, off by default);
- ``sdpa``: SDPA with the block-diagonal additive mask (a T x T mask: left out past
  ``--sdpa-max``, where it would not fit);
- ``sdpa-causal``: SDPA with ``is_causal=True`` and no mask (``optim.packing``'s kernel for rows
  of one document each under ``auto``, and stock's for such a row): only such rows are timed with it;
- ``sdpa-causal-split``: the same, one group of query heads a call (``backends.sdpa_causal_split``),
  so each call's backward holds one group's buffers: rows of one document only.

It says which kernel is fastest at which document length, and on CUDA what one forward + backward
holds at its peak, the evidence ``optim.packing``'s ``auto`` choices cite. Rows (``kind = "attention_kernel"``) go to ``results/packing/<gpu>.jsonl``,
beside the packing sweep's.

    python -m harness.bench.attention [--model llama-3.1-8b] [--lengths 8192 32768 65536]
        [--doc-lens 0 2048] [--backends flex varlen varlen-split sdpa sdpa-causal]
"""

from __future__ import annotations

import argparse

import torch

import optim.packing as P
from optim.packing import backends as PB
from harness.bench import add_store_arguments, store
from harness.measure.timing import percentiles
from harness.workload import models as registry

BACKENDS = ("flex", "varlen", "varlen-split", "sdpa", "sdpa-causal", "sdpa-causal-split")
SDPA_MAX = 32768  # the additive mask is T x T: 2 GiB in bf16 at 32768


def _kernel(backend: str):
    """``(entry, q, k, v, scale) -> out``: optim.packing's kernel, as its layers call it."""
    if backend == "sdpa-causal":
        return lambda entry, q, k, v, scale: PB.sdpa_causal(q, k, v, scale)
    if backend == "sdpa-causal-split":
        return lambda entry, q, k, v, scale: PB.sdpa_causal_split(q, k, v, scale)
    if backend == "varlen-split":
        return lambda entry, q, k, v, scale: P.KERNELS["varlen"](entry, q, k, v, scale, None, None, True, split=True)
    fn = P.KERNELS[backend]
    return lambda entry, q, k, v, scale: fn(entry, q, k, v, scale, None, None, True)


def _timed(fn, warmup: int, repeats: int, device: torch.device) -> dict:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        import time
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
        return percentiles(samples)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return percentiles([s.elapsed_time(e) for s, e in events])


def attention_flops(lengths: tuple[int, ...], heads: int, head_dim: int) -> float:
    """The forward's useful FLOPs: per document, causal QK^T and PV, 2 * 2 * H * D * n(n+1)/2."""
    return sum(2.0 * heads * head_dim * n * (n + 1) for n in lengths)


def measure(backend: str, seq_len: int, doc_len: int, *, heads: int, kv_heads: int, head_dim: int,
            warmup: int = 3, repeats: int = 10, device: torch.device | None = None) -> dict:
    """One kernel at one row layout: forward, and forward + backward, in ms."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    doc = doc_len or seq_len
    if seq_len % doc:
        raise ValueError(f"doc_len {doc_len} must divide seq_len {seq_len}")
    lengths = (doc,) * (seq_len // doc)
    if backend.startswith("sdpa-causal") and len(lengths) > 1:
        raise ValueError("sdpa-causal keeps no documents apart: rows of one document only")
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    grad = torch.randn(1, seq_len, heads, head_dim, device=device, dtype=dtype, generator=gen)
    entry = P.build_entry(("attention-bench", backend, seq_len, doc), P.PackedMetadata.from_lengths([lengths]), device)
    kernel, scale = _kernel(backend), head_dim ** -0.5
    P.reset_counters()  # this row's kernel calls alone

    def forward():
        with torch.no_grad():
            kernel(entry, q, k, v, scale)

    def forward_backward():
        out = kernel(entry, q, k, v, scale)
        torch.autograd.grad(out, (q, k, v), grad)

    fwd = _timed(forward, warmup, repeats, device)
    both = _timed(forward_backward, warmup, repeats, device)
    peak = None
    if device.type == "cuda":  # what one forward + backward holds at its peak, above its inputs
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / seq_len / 1024
    flops = attention_flops(lengths, heads, head_dim)
    return {"kind": "attention_kernel", "backend": backend, "seq_len": seq_len, "doc_len": doc, "num_docs": len(lengths),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
            "forward_ms": fwd, "forward_backward_ms": both, "forward_flops": flops,
            "forward_backward_peak_kib_per_token": peak,
            # FlashAttention's convention: the backward 2.5x the forward, its recomputed scores included
            # (harness.measure.flops counts 2x for MFU, so these TFLOP/s read about 17 % above that count)
            "forward_tflops": flops / fwd["p50"] / 1e9 if fwd["p50"] else None,
            "forward_backward_tflops": 3.5 * flops / both["p50"] / 1e9 if both["p50"] else None,
            "kernel_calls": P.kernels(), "status": "ok"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="whose attention geometry (heads, KV heads, head dim)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--doc-lens", type=int, nargs="+", default=[0, 2048],
                    help="document length within each row; 0 = one document the row's length")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--sdpa-max", type=int, default=SDPA_MAX, help="the longest row the masked sdpa runs at")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    add_store_arguments(ap, "packing")
    args = ap.parse_args(argv)
    for n in args.lengths:
        for d in args.doc_lens:
            if d < 0 or (d and n % d):
                ap.error(f"--doc-lens {d} does not divide --lengths {n} (0 is the row's own length)")
    from harness.measure.env import collect

    spec = registry.get(args.model)
    geometry = {"heads": spec.num_attention_heads, "kv_heads": spec.num_key_value_heads,
                "head_dim": spec.head_dim or spec.hidden_size // spec.num_attention_heads}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env, rows = collect(), []
    for n in args.lengths:
        # 0 is the row's own length: a document length given twice is measured once
        for d in dict.fromkeys(n if d in (0, n) else d for d in args.doc_lens):
            for b in args.backends:
                one_doc = d == n
                if (b.startswith("sdpa-causal") and not one_doc) or (b == "sdpa" and n > args.sdpa_max) \
                        or (b in ("flex", "varlen", "varlen-split") and device.type != "cuda"):
                    continue
                try:
                    row = measure(b, n, d, warmup=args.warmup, repeats=args.repeats, device=device, **geometry)
                except torch.OutOfMemoryError as e:
                    row = {"kind": "attention_kernel", "backend": b, "seq_len": n, "doc_len": d, **geometry,
                           "status": "oom", "message": str(e).split("\n")[0]}
                finally:
                    P.release()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                row["model"] = args.model
                rows.append(row)
                both = (row.get("forward_backward_ms") or {}).get("p50")
                print(f"{args.model} T={n} doc={d} {b:12s} fwd {(row.get('forward_ms') or {}).get('p50') or 0:9.2f} ms"
                      f"  fwd+bwd {both or 0:9.2f} ms  {row.get('forward_backward_tflops') or 0:6.1f} TFLOP/s"
                      f"  peak {row.get('forward_backward_peak_kib_per_token') or 0:6.1f} KiB/token  {row['status']}",
                      flush=True)
        path = store(args, rows, env, "harness.bench.attention", argv)  # each length's rows as soon as measured
    print(path)


if __name__ == "__main__":
    main()
