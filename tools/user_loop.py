"""The user's path timed in a plain loop, outside the harness: a model from its config, peft LoRA,
``optim.enable(model)`` with its defaults (or stock), fused AdamW, checkpointing, packed rows.

    python3 tools/user_loop.py --model gpt-oss-20b --seq-len 2048 --lora-rank 64 --stack user
    PYTHONPATH=/path/to/other/tree python3 tools/user_loop.py ...   # another revision's optim

One line of JSON per run: the step's median and p20-p80 from CUDA events (forward, backward and
optimizer), the forward and backward medians, and the host's issue time per step (from the step's
start until its last kernel is queued, before any wait): where the step is host-bound, the step
time follows the issue time, and Python's cycle collections in the timed steps (count by
generation, and their time). Run each configuration in a fresh process.
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
    ap.add_argument("--trainer-extras", nargs="+", default=None, metavar="SET", help=EXTRAS_HELP)
    ap.add_argument("--rounds", type=int, default=3, help="with --trainer-extras: interleaved blocks per set")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--steps and --rounds must be at least 1, --warmup at least 0")
    sets = list(dict.fromkeys(_extras(x, args.stack) for x in args.trainer_extras)) if args.trainer_extras else None
    switches = dict(kv.split("=", 1) for kv in args.set)

    import torch

    import optim
    import optim.collector
    import optim.packing
    from harness.workload import models

    raise_asked = optim.collector.SWITCHES["gc_threshold"].resolve(switches.get("gc_threshold"))  # OPTIM_GC_THRESHOLD too
    if sets and any("gc" in x for x in sets) and args.stack == "user" and raise_asked != "off":
        ap.error("the gc set compares optim.collector's raise against the process's collector: with --stack "
                 "user, leave gc_threshold off (also OPTIM_GC_THRESHOLD) so that the other sets run without the raise")

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
    common = {"label": args.label, "model": args.model, "seq_len": T, "stack": args.stack, "switches": switches,
              "checkpointing": not args.no_checkpointing,
              "optim_from": str(Path(optim.__file__).resolve().parent.parent)}
    if sets is not None:
        _compare(args, sets, model, opt, ids, labels, pos, kw, lengths, common)
        return 0
    step_ms, fwd_ms, bwd_ms, issue_ms, first_s = [], [], [], [], None
    collector = _Collections()
    for i in range(args.warmup + args.steps):
        collector.step_begins(timed=i >= args.warmup)
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
    out = {**common, "step_ms_p50": round(statistics.median(step_ms), 1), "step_ms_p20": round(_pct(step_ms, 0.2), 1),
           "step_ms_p80": round(_pct(step_ms, 0.8), 1), "forward_ms_p50": round(statistics.median(fwd_ms), 1),
           "backward_ms_p50": round(statistics.median(bwd_ms), 1),
           "issue_ms_p50": round(statistics.median(issue_ms), 1), "first_step_s": round(first_s, 1),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "step_ms": [round(x, 1) for x in step_ms], "issue_ms": [round(x, 1) for x in issue_ms],
           **collector.summary()}
    print(json.dumps(out), flush=True)
    return 0


class _Collections:
    """Python's cycle collections in each timed step, by generation, and the time they took
    (``gc.callbacks``): what the collector costs the step where it runs as the process left it."""

    def __init__(self):
        import gc

        self.steps: list[list[float]] = []  # per timed step: [gen0, gen1, gen2 count, ms]
        self._t0 = 0.0
        self._cur = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if self._cur is None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self._cur[info["generation"]] += 1
            self._cur[3] += (time.perf_counter() - self._t0) * 1e3

    def step_begins(self, timed: bool) -> None:
        self._cur = [0, 0, 0, 0.0] if timed else None
        if timed:
            self.steps.append(self._cur)

    def summary(self) -> dict:
        import gc

        if not self.steps:
            return {}
        n = len(self.steps)
        return {"gc_threshold": list(gc.get_threshold()),
                "gc_collections_per_step": [round(sum(s[g] for s in self.steps) / n, 2) for g in range(3)],
                "gc_ms_per_step_mean": round(sum(s[3] for s in self.steps) / n, 2),
                "gc_ms": [round(s[3], 1) for s in self.steps]}


def _step(model, opt, ids, labels, pos, kw) -> None:
    loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


GC_RAISE = 100000  # the gc set's young threshold: the value docs/optim.md gives for turning the switch on
EXTRAS = ("autocast", "clip", "walks", "nan", "h2d", "batch", "gc")
EXTRAS_HELP = (
    "time these sets of transformers.Trainer's per-step additions side by side in this process, one set "
    "per word, '+' joining extras ('plain': none): autocast (bf16=True: the forward under autocast to bf16, "
    "its outputs cast to fp32 as accelerate does), clip (max_grad_norm: clip_grad_norm_ over "
    "model.parameters()), walks (model.train(), the FLOPs count's num_parameters() and model.zero_grad(), "
    "each a walk of the module tree), nan (logging_nan_inf_filter: a host read of the loss after the "
    "backward), h2d (the batch copied from pinned host memory, as Trainer's loader does before the step "
    "begins: outside the step's events), batch (user stack only: the packing metadata made anew for "
    "each step, before it begins, as a collator makes it, so the attention structures are built in "
    "each step), gc (not Trainer's: optim.collector's raise, gc_threshold=100000, held for the set's "
    "blocks, so that the sets without it run the collector as the process has it; with --stack user it "
    "needs gc_threshold left off). Each set is warmed up once, then timed in --rounds interleaved blocks of --steps, each "
    "block after one untimed step, so a drift of the machine reaches every set alike")


def _extras(spec: str, stack: str) -> frozenset:
    parts = frozenset() if spec == "plain" else frozenset(spec.split("+"))
    bad = sorted(parts - set(EXTRAS))
    if bad:
        raise SystemExit(f"unknown Trainer extra(s) {bad} in {spec!r} (valid: plain, {', '.join(EXTRAS)})")
    if "batch" in parts and stack != "user":
        raise SystemExit("the batch extra makes optim's packing metadata anew: it needs --stack user")
    return parts


def _gc_block(model, extras, on: bool) -> None:
    """Hold (or let go of) optim.collector's raise for a block of the ``gc`` set."""
    import optim.collector

    if "gc" in extras:
        if on:
            optim.collector.enable(model, gc_threshold=GC_RAISE)
        else:
            optim.collector.disable(model)


def _before_step(batch, kw, extras, lengths):
    """What Trainer does for a step before its begin callback: its loader copies the batch to the
    GPU (blocking, accelerate's default) from the collator's pinned tensors and metadata."""
    import optim.packing

    if "batch" in extras:
        kw = optim.packing.packed_kwargs(optim.packing.PackedMetadata.from_lengths([lengths]))
    if "h2d" in extras:
        batch = {k: v.to("cuda") for k, v in batch.items()}
    return batch, kw


def _extra_step(model, opt, batch, kw, extras) -> None:
    """One step of the plain loop with ``extras``, Trainer's per-step additions, in Trainer's order."""
    import contextlib

    import torch

    if "walks" in extras:
        model.train()
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if "autocast" in extras else contextlib.nullcontext()
    with ctx:
        out = model(**batch, use_cache=False, **kw)
    if "autocast" in extras:
        from accelerate.utils import convert_to_fp32

        out = convert_to_fp32(out)
    loss = out.loss
    loss.backward()
    if "nan" in extras and (torch.isnan(loss) or torch.isinf(loss)):
        pass  # Trainer skips the step's loss in its log; the read is the cost
    if "clip" in extras:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if "walks" in extras:
        model.num_parameters(exclude_embeddings=True)  # Trainer's FLOPs count, each step
        model.zero_grad(set_to_none=True)
    else:
        opt.zero_grad(set_to_none=True)


def _compare(args, sets, model, opt, ids, labels, pos, kw, lengths, common: dict) -> None:
    """Each set of extras warmed up once, then ``rounds`` interleaved blocks of ``steps`` timed
    steps, each block after one untimed step; one JSON line per set."""
    import torch

    gpu = {"input_ids": ids, "labels": labels, "position_ids": pos}
    host = {k: v.cpu().pin_memory() for k, v in gpu.items()}
    times = {s: ([], []) for s in sets}
    counts = {s: _Collections() for s in sets}
    for rnd in range(args.rounds + 1):  # round 0 warms each set up (autocast compiles its own graphs)
        for extras in sets:
            for c in counts.values():  # the raise's first collection is no set's step
                c.step_begins(timed=False)
            _gc_block(model, extras, on=True)
            for k in range(args.warmup if rnd == 0 else args.steps + 1):
                for c in counts.values():
                    c.step_begins(timed=c is counts[extras] and bool(rnd and k))
                batch, step_kw = _before_step(host if "h2d" in extras else gpu, kw, extras, lengths)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                _extra_step(model, opt, batch, step_kw, extras)
                end.record()
                issued = time.perf_counter() - t0
                torch.cuda.synchronize()
                if rnd and k:  # the block's first step follows another set's: untimed
                    times[extras][0].append(start.elapsed_time(end))
                    times[extras][1].append(issued * 1e3)
            _gc_block(model, extras, on=False)
    for c in counts.values():
        c.step_begins(timed=False)
    for extras, (step_ms, issue_ms) in times.items():
        gc_counts = counts[extras].summary()
        gc_counts.pop("gc_threshold", None)
        gc_counts.pop("gc_ms", None)
        print(json.dumps({**common, "trainer_extras": "+".join(sorted(extras)) or "plain",
                          "step_ms_p50": round(statistics.median(step_ms), 1),
                          "step_ms_p20": round(_pct(step_ms, 0.2), 1), "step_ms_p80": round(_pct(step_ms, 0.8), 1),
                          "issue_ms_p50": round(statistics.median(issue_ms), 1), "steps": len(step_ms),
                          **gc_counts}), flush=True)


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
