"""The user's path timed in a plain loop, outside the harness: a model from its config, peft LoRA,
``optim.enable(model)`` with its defaults (or stock), fused AdamW, checkpointing, packed rows.

    python3 tools/user_loop.py --model gpt-oss-20b --seq-len 2048 --lora-rank 64 --stack user
    PYTHONPATH=/path/to/other/tree python3 tools/user_loop.py ...   # another revision's optim

One line of JSON per run: the step's median and p20-p80 from CUDA events (forward, backward and
optimizer), the forward and backward medians, and the host's issue time per step (from the step's
start until its last kernel is queued, before any wait): where the step is host-bound, the step
time follows the issue time. Run each configuration in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: another tree's optim wins


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a name of harness.workload.models (e.g. gpt-oss-20b)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens per packed document")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA rank on attention (and experts on MoE models)")
    ap.add_argument("--stack", choices=("stock", "user"), default="user",
                    help="stock transformers + peft, or the same with optim.enable(model)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--label", default="", help="a name for this run in the output line")
    ap.add_argument("--set", action="append", default=[], metavar="SWITCH=VALUE",
                    help="an optim switch passed to optim.enable (repeatable), e.g. --set validate=false")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="build the model without gradient checkpointing (what the recompute costs)")
    ap.add_argument("--host-profile", metavar="PATH", default=None,
                    help="also profile the host side of one more step with cProfile (forward, backward and "
                         "optimizer issue; the GPU is waited for after it) and write the top functions to PATH")
    args = ap.parse_args(argv)
    switches = dict(kv.split("=", 1) for kv in args.set)

    import torch

    import optim
    import optim.packing
    from harness.workload import models

    spec = models.get(args.model)
    attn = "flex_attention" if spec.family == "gpt_oss" else "sdpa"
    model = models.build(spec, device="cuda", dtype=torch.bfloat16, attn_implementation=attn,
                         experts_implementation="grouped_mm" if spec.is_moe else None, lora_rank=args.lora_rank,
                         gradient_checkpointing=not args.no_checkpointing)
    if args.stack == "user":
        optim.enable(model, **switches)  # strings: each switch parses its own (as from its environment variable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    T = args.seq_len
    lengths = [args.doc_len] * (T // args.doc_len) + ([T % args.doc_len] if T % args.doc_len else [])
    meta = optim.packing.PackedMetadata.from_lengths([lengths])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (1, T), generator=g).cuda()
    pos = meta.position_ids().cuda()
    labels = ids.masked_fill(pos == 0, -100)
    kw = optim.packing.packed_kwargs(meta) if args.stack == "user" else {}
    step_ms, fwd_ms, bwd_ms, issue_ms, first_s = [], [], [], [], None
    for i in range(args.warmup + args.steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        t0 = time.perf_counter()
        ev[0].record()
        loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw).loss
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        if first_s is None:
            first_s = time.perf_counter() - t0
        if i >= args.warmup:
            step_ms.append(ev[0].elapsed_time(ev[3]))
            fwd_ms.append(ev[0].elapsed_time(ev[1]))
            bwd_ms.append(ev[1].elapsed_time(ev[2]))
            issue_ms.append(issued * 1e3)
    if args.host_profile:
        _host_profile(args.host_profile, lambda: _step(model, opt, ids, labels, pos, kw))
    out = {"label": args.label, "model": args.model, "seq_len": T, "stack": args.stack, "switches": switches,
           "checkpointing": not args.no_checkpointing,
           "optim_from": str(Path(optim.__file__).resolve().parent.parent),
           "step_ms_p50": round(statistics.median(step_ms), 1), "step_ms_p20": round(_pct(step_ms, 0.2), 1),
           "step_ms_p80": round(_pct(step_ms, 0.8), 1), "forward_ms_p50": round(statistics.median(fwd_ms), 1),
           "backward_ms_p50": round(statistics.median(bwd_ms), 1),
           "issue_ms_p50": round(statistics.median(issue_ms), 1), "first_step_s": round(first_s, 1),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "step_ms": [round(x, 1) for x in step_ms], "issue_ms": [round(x, 1) for x in issue_ms]}
    print(json.dumps(out), flush=True)
    return 0


def _step(model, opt, ids, labels, pos, kw) -> None:
    loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _host_profile(path: str, step) -> None:
    """cProfile of one step's host work, up to its last queued kernel: where a host-bound step's
    time goes, by Python function (own time and cumulative; ``harness.measure.hostprofile``)."""
    import cProfile

    import torch

    from harness.measure import hostprofile

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    torch.cuda.synchronize()
    hostprofile.write(prof, path, steps=1, title="own loop: one step")


if __name__ == "__main__":
    sys.exit(main())
