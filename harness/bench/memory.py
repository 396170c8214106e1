"""Where one training step's memory peak goes: the tensors live at the peak, by the code that made them.

One model (a registry shape, random weights, LoRA on every linear layer) and one row of
``--seq-len`` tokens (one document, or documents of ``--doc-len``), on one CUDA GPU: ``--warmup``
steps (compiling, the recompute policy's measurement), then one step recorded with the caching
allocator's memory history (``torch.cuda.memory._record_memory_history``) and replayed
(``harness.measure.memtrace``): the most bytes the step held at once above its start, the phase it
came in (forward, backward, optimizer), and the blocks live then grouped by their allocating code.
The replayed peak is written beside the allocator's own (``max_memory_allocated``, less the start),
so a row shows whether the replay accounts for it.

``--stack user`` is ``optim.enable(model, **switches)`` with the ``--set`` switches; ``--stack
stock`` is the model as built (gradient checkpointing on). Rows (``kind = "memory_peak"``) go to
``results/<experiment>/<gpu>.jsonl`` (``context`` by default); an out-of-memory step is an ``oom``
row.

    python -m harness.bench.memory --model llama-3.1-8b --seq-len 65536 \\
        --set recompute=all offload=double mlp_chunk=4096
"""

from __future__ import annotations

import argparse
import sys

import torch

from harness.bench import add_store_arguments, store
from harness.measure import memtrace
from harness.workload import models as registry

PHASES = ("forward", "backward", "optimizer")
GIB = 2**30
MAX_EVENTS = 4_000_000  # the history is a ring of this many events: a longer step loses its first ones


def parse_settings(pairs: list[str]) -> dict:
    """``key=value`` pairs as optim.enable takes them: integers and true/false read as such."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes key=value pairs, got {pair!r}")
        low = value.lower()
        out[key] = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(low, value)
    return out


def batch(seq_len: int, doc_len: int, vocab: int, device) -> dict:
    """One row of ``seq_len`` random tokens, documents of ``doc_len`` (0: one document)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g).to(device)
    pos = torch.arange(seq_len) % (doc_len or seq_len)
    return {"input_ids": ids, "labels": ids, "position_ids": pos[None].to(device), "use_cache": False}


def measure(model_name: str, seq_len: int, doc_len: int, stack: str, settings: dict, *, warmup: int,
            lora_rank: int, top: int, stacks: str = "python") -> dict:
    import optim

    spec = registry.get(model_name)
    model = registry.build(spec, device="cuda", dtype=torch.bfloat16, lora_rank=lora_rank)
    if stack == "user":
        optim.enable(model, **settings)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    kwargs = batch(seq_len, doc_len, spec.vocab_size, "cuda")

    def mark(k):
        torch.empty(memtrace.phase_marker(k), dtype=torch.uint8, device="cuda")  # freed at once

    def step(marked: bool):
        if marked:
            mark(0)
        loss = model(**kwargs).loss
        if marked:
            mark(1)
        loss.backward()
        if marked:
            mark(2)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(warmup):
        step(False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks=stacks)
    try:
        loss = step(True)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocator_peak = torch.cuda.max_memory_allocated()
    events = snap["device_traces"][torch.cuda.current_device()]
    if len(events) >= MAX_EVENTS:  # the ring wrapped: the step's first events (its start, a peak) are gone
        raise RuntimeError(f"the step made {len(events)} or more allocator events, past the history's "
                           f"{MAX_EVENTS}: its replay would miss the first ones")
    found = memtrace.replay(events, PHASES)
    kib = 1024 * seq_len
    groups = [{**g, "gib": g["bytes"] / GIB, "kib_per_token": g["bytes"] / kib} for g in found["groups"]]
    rest = groups[top:]
    if rest:
        groups = groups[:top] + [{"site": f"{len(rest)} other sites", "bytes": sum(g["bytes"] for g in rest),
                                  "blocks": sum(g["blocks"] for g in rest),
                                  "gib": sum(g["gib"] for g in rest), "kib_per_token": sum(g["kib_per_token"] for g in rest)}]
    return {"loss": loss, "start_gib": start / GIB, "allocator_peak_gib": allocator_peak / GIB,
            "step_peak_gib": (allocator_peak - start) / GIB, "replayed_peak_gib": found["peak_bytes"] / GIB,
            "peak_kib_per_token": found["peak_bytes"] / kib, "phase": found["phase"], "events": found["events"],
            "groups": groups, "status": "ok"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--doc-len", type=int, default=0, help="documents of this many tokens; 0 = one document")
    ap.add_argument("--stack", choices=("user", "stock"), default="user")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="optim switches for --stack user")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="sites named in the row; the rest summed")
    ap.add_argument("--stacks", choices=("python", "all"), default="python",
                    help="all: C++ frames too, naming the operator that allocated inside a kernel or the "
                         "autograd engine (slower to record)")
    add_store_arguments(ap, "context")
    args = ap.parse_args(argv)
    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        ap.error(str(e))
    if settings and args.stack != "user":
        ap.error("--set configures optim: it needs --stack user")
    if args.doc_len < 0 or (args.doc_len and args.seq_len % args.doc_len):
        ap.error(f"--doc-len {args.doc_len} does not divide --seq-len {args.seq_len} (0 is one document)")
    if not torch.cuda.is_available():
        sys.exit("harness.bench.memory needs a CUDA GPU: it reads the CUDA caching allocator's memory history")
    from harness.measure.env import collect

    env = collect()
    row = {"kind": "memory_peak", "model": args.model, "seq_len": args.seq_len, "doc_len": args.doc_len,
           "stack": args.stack, "settings": dict(sorted(settings.items())), "lora_rank": args.lora_rank,
           "warmup_steps": args.warmup, "stacks": args.stacks}
    try:
        row.update(measure(args.model, args.seq_len, args.doc_len, args.stack, settings, warmup=args.warmup,
                           lora_rank=args.lora_rank, top=args.top, stacks=args.stacks))
    except torch.OutOfMemoryError as e:
        row.update(status="oom", message=str(e).split("\n")[0])
    if row["status"] == "ok":
        print(f"{args.model} T={args.seq_len}: step peak {row['step_peak_gib']:.2f} GiB above its start "
              f"(replayed {row['replayed_peak_gib']:.2f}, {row['peak_kib_per_token']:.1f} KiB a token) "
              f"in the {row['phase']}")
        for g in row["groups"]:
            print(f"  {g['gib']:8.3f} GiB {g['kib_per_token']:7.1f} KiB/token {g['blocks']:5d} blocks  {g['site']}")
    else:
        print(f"{args.model} T={args.seq_len}: {row['status']}: {row.get('message')}")
    print(store(args, [row], env, "harness.bench.memory", argv))


if __name__ == "__main__":
    main()
