"""Linear + cross-entropy kernels side by side, in one process: the stock full-logits
loss, ``optim.loss`` (its compiled and eager chunk kernels), Liger-Kernel's fused linear
cross-entropy and Apple's cut-cross-entropy, on the lm_head shapes of the models the sweeps run.

Each (shape, weight mode, kernel) gives one ``loss_kernel`` row:

- the time of the loss forward + backward (CUDA events, warm-up, median with p20/p80);
- the peak memory it adds above its inputs (``max_memory_allocated`` minus what was allocated
  before it);
- its error against an fp32 reference on the same inputs, beside the stock bf16 loss's own error,
  for the loss and the hidden-state (and weight) gradients: a kernel is as exact as stock when its
  error is of the stock error's size.

A kernel that is not installed or has no path on this device gives a row with
``status = "unavailable"`` and the reason; an out-of-memory gives ``status = "oom"``.

    python -m harness.bench.loss [--shapes qwen3-8b gpt-oss-20b long-vocab] [--modes frozen trained]
        [--kernels stock optim-compiled optim-eager liger cce cce-filtered]
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F

import optim.loss as L
from harness.bench import add_store_arguments, store
from harness.measure.timing import percentiles

# name: (tokens, hidden size, vocabulary), the lm_heads of the models the sweeps run; long-vocab
# is cut-cross-entropy's published setting (16k tokens, a 248k vocabulary)
SHAPES = {
    "qwen3-0.6b": (8192, 1024, 151936),
    "qwen3-8b": (8192, 4096, 151936),
    "gpt-oss-20b": (2048, 2880, 201088),
    "long-vocab": (16384, 4096, 248320),
    "tiny": (300, 32, 517),  # a test shape: a short last chunk, a vocabulary not a power of two
}
DEFAULT_SHAPES = ["qwen3-0.6b", "qwen3-8b", "gpt-oss-20b", "long-vocab"]
KERNELS = ["stock", "optim-compiled", "optim-eager", "liger", "cce", "cce-filtered"]
# frozen: lm_head frozen, as in LoRA (only the hidden states get a gradient); trained: both
MODES = ["frozen", "trained"]


class Unavailable(Exception):
    """This kernel cannot run here (not installed, no path on this device)."""


def _stock(h, w, y, denom):
    logits = (h @ w.t()).float()  # transformers: lm_head in the model dtype, the loss in fp32
    return F.cross_entropy(logits, y, ignore_index=L.IGNORE_INDEX, reduction="sum") / denom


def _peer(module: str, package: str, h):
    """The peer's module, or Unavailable saying why it cannot run here."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{package} is not installed (the peers extra)") from e
    if h.device.type != "cuda":
        raise Unavailable(f"{package}'s Triton kernels run on CUDA only")
    return mod


def _liger(h, w, y, denom):
    mod = _peer("liger_kernel.transformers", "liger-kernel", h)
    return mod.LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, y) / denom


def _cce(filtered: bool):
    def run(h, w, y, denom):
        mod = _peer("cut_cross_entropy", "cut-cross-entropy", h)
        # filtered: its default, which skips softmax entries below bf16 resolution in the gradient
        eps = "high" if filtered else None
        return mod.linear_cross_entropy(h, w, y, ignore_index=L.IGNORE_INDEX, reduction="sum", filter_eps=eps) / denom
    return run


def _optim(kernel: str):
    def run(h, w, y, denom):
        return L.linear_cross_entropy(h, w, y, num_items_in_batch=denom, kernel=kernel)
    return run


IMPLS = {"stock": _stock, "optim-compiled": _optim("compiled"), "optim-eager": _optim("eager"),
         "liger": _liger, "cce": _cce(False), "cce-filtered": _cce(True)}


def inputs(shape: str, device: torch.device, dtype: torch.dtype, *, seed: int = 0):
    """Hidden states, an lm_head weight and labels (one in 8 ignored) of ``shape``, at the scale
    of a trained model's (logits of a few units), so the softmax is neither flat nor one-hot."""
    n, hidden, vocab = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * (3.0 / hidden ** 0.5)).to(device, dtype)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::8] = L.IGNORE_INDEX
    return h, w, y.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def reference(h, w, y, denom, trained: bool) -> dict:
    """The fp32 loss and gradients of the same bf16 inputs (optim's eager chunks, in fp32)."""
    hf = h.float().requires_grad_(True)
    wf = w.float().requires_grad_(trained)
    loss = L.linear_cross_entropy(hf, wf, y, num_items_in_batch=denom, kernel="eager")
    loss.backward()
    out = {"loss": loss.detach(), "grad_h": hf.grad}
    if trained:
        out["grad_w"] = wf.grad
    return out


def measure(kernel: str, h, w, y, denom, *, trained: bool, ref: dict, warmup: int, repeats: int) -> dict:
    """Time, peak memory above the inputs, and error against ``ref`` of one kernel."""
    fn = IMPLS[kernel]
    cuda = h.device.type == "cuda"
    hh = h.detach().clone().requires_grad_(True)
    ww = w.detach().clone().requires_grad_(trained)

    def once():
        hh.grad = ww.grad = None
        loss = fn(hh, ww, y, denom)
        loss.backward()
        return loss

    out: dict = {}
    try:
        loss = once()  # the first call (compiles where it compiles) also gives the numerics
        out["loss_err"] = abs(loss.item() - ref["loss"].item()) / abs(ref["loss"].item())
        out["grad_h_err"] = _rel(hh.grad, ref["grad_h"])
        out["grad_w_err"] = _rel(ww.grad, ref["grad_w"]) if trained else None
        for _ in range(warmup):
            once()
        samples = []
        for _ in range(repeats):
            hh.grad = ww.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                once()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
                # the gradients it returns are the caller's; what it held meanwhile is the peak
                out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            else:
                import time

                t0 = time.perf_counter()
                once()
                samples.append((time.perf_counter() - t0) * 1e3)
        p = percentiles(samples)
        out.update(status="ok", ms=p["p50"], ms_p20=p["p20"], ms_p80=p["p80"], ms_samples=p["samples"])
    except Unavailable as e:
        out = {"status": "unavailable", "error": str(e)}
    except torch.OutOfMemoryError as e:
        out = {"status": "oom", "error": str(e).splitlines()[0][:300]}
    finally:
        hh.grad = ww.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def run(shapes: list[str], modes: list[str], kernels: list[str], *, device: torch.device,
        warmup: int = 3, repeats: int = 10) -> list[dict]:
    dtype = torch.bfloat16
    rows = []
    for shape in shapes:
        h, w, y = inputs(shape, device, dtype)
        denom = (y != L.IGNORE_INDEX).sum()
        n, hidden, vocab = SHAPES[shape]
        for mode in modes:
            trained = mode == "trained"
            ref = reference(h, w, y, denom, trained)
            for kernel in kernels:
                r = measure(kernel, h, w, y, denom, trained=trained, ref=ref, warmup=warmup, repeats=repeats)
                rows.append({"kind": "loss_kernel", "model": shape, "tokens": n, "hidden": hidden,
                             "vocab": vocab, "mode": mode, "backend": kernel, "device_type": device.type,
                             "chunk_tokens": L.chunk_tokens(vocab) if kernel.startswith("optim") else None, **r})
                _print(rows[-1])
            del ref
            gc.collect()
        del h, w, y
    return rows


def _print(r: dict) -> None:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    if r["status"] != "ok":
        print(f"{r['model']:12s} {r['mode']:8s} {r['backend']:15s} {r['status']}: {r.get('error', '')}", flush=True)
        return
    print(f"{r['model']:12s} {r['mode']:8s} {r['backend']:15s} {r['ms']:9.2f} ms "
          f"[{r['ms_p20']:.2f}-{r['ms_p80']:.2f}]  peak {f(r.get('peak_gib'), '6.3f')} GiB  "
          f"loss err {r['loss_err']:.2e}  dh err {r['grad_h_err']:.2e}  dW err {f(r['grad_w_err'], '.2e')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.loss", description=__doc__.split("\n\n")[0])
    add_store_arguments(ap, "loss")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=sorted(SHAPES))
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = run(args.shapes, args.modes, args.kernels, device=device, warmup=args.warmup, repeats=args.repeats)
    from harness.measure import env as envmod

    path = store(args, rows, envmod.collect(), "harness.bench.loss", argv)
    print(f"\nstored {len(rows)} rows in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
