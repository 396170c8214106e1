"""One MoE layer at real shapes: host syncs, the routing path alone, the expert layer, split LoRA.

    python -m harness.bench.moe --model gpt-oss-20b --model qwen3-30b-a3b
    python -m harness.bench.moe --out /tmp/m.json --model gpt-oss-20b-tiny --device cpu --dtype fp32 \
        --tokens 256 --iters 3        # CPU smoke

Rows (``kind``):
- ``moe_syncs``: host syncs of one experts layer, forward and forward+backward, per backend;
  ``counted`` = optim.moe's explicit sync points, ``observed`` = CUDA sync debug mode (None on CPU);
  ``per_model_forward`` = counted forward syncs × num_layers.
- ``moe_routing``: the routing path alone (group/gather rows per expert, weight, scatter back; no
  expert GEMMs), forward and backward ms {p20,p50,p80,samples}, per backend and token count.
- ``moe_experts``: the whole experts layer (routing + expert GEMMs), per backend and LoRA mode
  (``none``, ``merged`` = peft's W + B·A, ``split`` = (X·A_e)·B_e on routed rows).
- ``moe_query_model``: dynamic queries per layer (E for loop, 1 for sorted, 0 for grouped_mm),
  per-query cost c = (loop − sorted)/(E − 1) measured on the routing path at each token count,
  the saving predicted from the median c vs the one measured, and the predicted saving per model
  forward (num_layers × (E − 1) × c; double it per training step under gradient checkpointing).
- ``moe_split_crossover``: the published FLOP crossover s* = E·m·n / (k·(m+n)) · (1 + 1/(2r)) per
  projection, with the FLOPs of merged and split LoRA at each measured token count.

Timings: CUDA events (one sync at the end), ``--warmup`` untimed iterations, median and p20/p80
of ``--iters``. Routing is random top-k (uniform over experts) with softmax weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn

from harness.bench import add_store_arguments, store
from harness.measure import env as envmod
from harness.measure.timing import PhaseTimer, percentiles
from harness.variant_keys import SWITCHES
from harness.workload import models as model_registry

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# every choice of optim.moe's backend switch but "auto"
BACKENDS = tuple(b for b in SWITCHES["moe_backend"].choices if b != "auto")


class _MoeLayer(nn.Module):
    """Just the experts of one MoE block, so peft can target ``experts.gate_up_proj`` as in the model."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, idx, wts):
        return self.experts(hidden, idx, wts)


def _experts_class(family: str):
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts


def build_layer(spec, device, dtype, lora_rank: int | None):
    config = spec.config()
    with torch.device(device):
        experts = _experts_class(spec.family)(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.02))
    layer = _MoeLayer(experts).to(dtype=dtype)
    layer.requires_grad_(False)
    if lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        cfg = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                         target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        layer = inject_adapter_in_model(cfg, layer)
        with torch.no_grad():  # nonzero B, as after some training
            for n, p in layer.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.02)
    return layer


def dims(spec):
    """(E, k, hidden, expert intermediate)."""
    inter = spec.extra.get("moe_intermediate_size", spec.intermediate_size)
    return spec.num_experts, spec.experts_per_token, spec.hidden_size, inter


def make_routing(T, E, k, H, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top, idx = logits.topk(k, dim=-1)
    wts = torch.softmax(top, dim=-1)
    hidden = torch.randn(T, H, generator=g).mul_(0.5)
    return hidden.to(device, dtype), idx.to(device), wts.to(device, dtype)


def time_fwd_bwd(fwd, device, warmup, iters):
    """fwd() returns a tensor; its backward is timed separately with a fixed upstream gradient."""
    timer = PhaseTimer(("forward", "backward"), torch.device(device))
    grad = None
    for i in range(warmup + iters):
        if i == warmup:
            timer.discard()
        timer.start_step()
        out = fwd()
        timer.mark()
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        timer.mark()
    ms = timer.results_ms()
    return percentiles(ms["forward"]), percentiles(ms["backward"])


def split_crossover(E, k, m, n, r):
    return E * m * n / (k * (m + n)) * (1 + 1 / (2 * r))


def lora_flops(E, k, m, n, r, s):
    """Extra FLOPs of LoRA on one (m → n) projection: peft materializes B·A for all E experts
    (2mnr) and adds it to W (mn); split runs X·A then ·B on the k·s routed pairs."""
    return {"merged": E * (2 * m * n * r + m * n), "split": 2 * k * s * r * (m + n)}


def bench_model(name, args, device, dtype, emit):
    import optim.moe as moe
    from optim import _moe_ops as ops

    spec = model_registry.get(name)
    E, k, H, inter = dims(spec)
    L = spec.num_hidden_layers
    base = {"model": name, "family": spec.family, "num_experts": E, "top_k": k, "hidden": H,
            "intermediate": inter, "num_layers": L, "dtype": args.dtype}
    backends = [b for b in args.backends if b != "grouped_mm" or ops.grouped_mm_available(device)]

    layer = build_layer(spec, device, dtype, args.rank)
    T0 = args.tokens[0]

    # -- host syncs per layer, and per model forward ----------------------------------------------
    hidden, idx, wts = make_routing(T0, E, k, H, device, dtype)
    hidden.requires_grad_(True)
    for backend in backends:
        moe.enable(layer, moe_backend=backend, moe_lora="split")
        layer(hidden, idx, wts).float().sum().backward()  # warm-up
        with moe.count_host_syncs(device) as fwd_s:
            out = layer(hidden, idx, wts)
        with moe.count_host_syncs(device) as bwd_s:
            out.float().sum().backward()
        emit({**base, "kind": "moe_syncs", "backend": backend, "tokens": T0,
              "forward_counted": fwd_s.counted, "forward_observed": fwd_s.observed,
              "backward_counted": bwd_s.counted, "backward_observed": bwd_s.observed,
              "per_model_forward": fwd_s.counted * L,
              # observed counts torch's sync warnings alone, not its notice on entering the debug mode
              "observed_syncs_only": True})

    # -- the routing path alone, then the whole experts layer --------------------------------------
    routing_ms: dict[tuple[int, str], float] = {}
    for T in args.tokens:
        hidden, idx, wts = make_routing(T, E, k, H, device, dtype, seed=T)
        for backend in backends:
            def fwd():
                h = hidden.detach().requires_grad_(True)
                return ops.dispatch_only(backend, h, idx, wts, E)

            f, b = _guarded(lambda: time_fwd_bwd(fwd, device, args.warmup, args.iters))
            if f is not None:
                routing_ms[(T, backend)] = f["p50"]
            emit({**base, "kind": "moe_routing", "backend": backend, "tokens": T,
                  "forward_ms": f, "backward_ms": b, "status": "ok" if f else "oom"})
        for lora in args.lora:
            for backend in backends:
                moe.enable(layer, moe_backend=backend, moe_lora="merged" if lora == "merged" else "split")
                # "none": disable the adapters (peft calls the bare experts with our backend)
                ctx = _adapters_off(layer) if lora == "none" else _nullctx()

                def layer_fwd():
                    h = hidden.detach().requires_grad_(True)
                    return layer(h, idx, wts)

                with ctx:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    f, b = _guarded(lambda: time_fwd_bwd(layer_fwd, device, args.warmup, args.iters))
                peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
                emit({**base, "kind": "moe_experts", "backend": backend, "lora": lora,
                      "lora_rank": args.rank, "tokens": T, "forward_ms": f, "backward_ms": b,
                      "peak_allocated_gib": peak, "status": "ok" if f else "oom"})

    # -- the dynamic-query model --------------------------------------------------------------------
    per_query = {T: (routing_ms[(T, "loop")] - routing_ms[(T, "sorted")]) / (E - 1)
                 for T in args.tokens if (T, "loop") in routing_ms and (T, "sorted") in routing_ms}
    if per_query:
        c = statistics.median(per_query.values())
        for T, cT in per_query.items():
            measured = routing_ms[(T, "loop")] - routing_ms[(T, "sorted")]
            emit({**base, "kind": "moe_query_model", "tokens": T,
                  "queries_per_layer": {"loop": E, "sorted": 1, "grouped_mm": 0},
                  "per_query_ms": cT, "per_query_ms_median": c,
                  "predicted_saving_ms": (E - 1) * c, "measured_saving_ms": measured,
                  "predicted_saving_per_model_forward_ms": L * (E - 1) * c,
                  "loop_forward_ms": routing_ms[(T, "loop")], "sorted_forward_ms": routing_ms[(T, "sorted")]})

    # -- split LoRA crossover (FLOPs), per projection -------------------------------------------------
    r = args.rank
    for proj, (m, n) in {"gate_up_proj": (H, 2 * inter), "down_proj": (inter, H)}.items():
        s_star = split_crossover(E, k, m, n, r)
        for T in args.tokens:
            fl = lora_flops(E, k, m, n, r, T)
            emit({**base, "kind": "moe_split_crossover", "projection": proj, "m": m, "n": n,
                  "lora_rank": r, "tokens": T, "crossover_tokens": s_star,
                  "merged_lora_flops": fl["merged"], "split_lora_flops": fl["split"],
                  "split_cheaper": T < s_star})


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _adapters_off:
    def __init__(self, layer):
        self.wrappers = [m for m in layer.modules() if hasattr(m, "disable_adapters") and hasattr(m, "lora_A")]

    def __enter__(self):
        for w in self.wrappers:
            w.enable_adapters(False)

    def __exit__(self, *exc):
        for w in self.wrappers:
            w.enable_adapters(True)
        return False


def _guarded(fn):
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def _fmt(p):
    return "-" if not p else f"{p['p50']:.2f}"


def print_table(rows):
    print(f"{'model':<20}{'kind':<13}{'backend':<11}{'lora':<7}{'tokens':>7}{'fwd ms':>10}{'bwd ms':>10}")
    for r in rows:
        if r["kind"] in ("moe_routing", "moe_experts"):
            print(f"{r['model']:<20}{r['kind']:<13}{r['backend']:<11}{r.get('lora', '-'):<7}{r['tokens']:>7}"
                  f"{_fmt(r['forward_ms']):>10}{_fmt(r['backward_ms']):>10}")
    for r in rows:
        if r["kind"] == "moe_syncs":
            print(f"{r['model']:<20}syncs/layer  {r['backend']:<11} fwd counted={r['forward_counted']} "
                  f"observed={r['forward_observed']} bwd observed={r['backward_observed']} "
                  f"per model fwd={r['per_model_forward']}")
        elif r["kind"] == "moe_query_model":
            print(f"{r['model']:<20}query model  T={r['tokens']}: c={r['per_query_ms']:.4f} ms/query, "
                  f"saving predicted {r['predicted_saving_ms']:.2f} vs measured {r['measured_saving_ms']:.2f} ms/layer")
        elif r["kind"] == "moe_split_crossover" and r["tokens"] == rows[0].get("tokens"):
            print(f"{r['model']:<20}crossover    {r['projection']}: s* = {r['crossover_tokens']:.0f} tokens")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.moe", description=__doc__.split("\n")[0])
    add_store_arguments(ap, "moe")
    ap.add_argument("--model", action="append", help="registry name (repeatable); default gpt-oss-20b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--lora", nargs="+", default=["none", "merged", "split"], choices=["none", "merged", "split"])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    rows: list[dict] = []

    def emit(row):
        rows.append(row)

    for name in args.model or ["gpt-oss-20b"]:
        bench_model(name, args, device, dtype, emit)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    path = store(args, rows, envmod.collect(), "harness.bench.moe", argv)
    print_table(rows)
    print(f"stored {len(rows)} rows in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
