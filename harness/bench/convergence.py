"""Convergence on real text: each stack trains the same model on the Python standard library's own
source, which ships with every Python, so nothing is downloaded.

The corpus is every ``.py`` file under ``sysconfig``'s stdlib folder, in sorted order, up to
``--corpus-mib``; one file in ``HELD_OUT_EVERY`` is held out. Tokens are bytes (0-255) and an
end-of-document id, so the vocabulary is ``VOCAB`` and a model that learned nothing scores
ln ``VOCAB``. Documents are packed into rows of ``--seq-len`` tokens by transformers'
``DataCollatorWithFlattening`` (position ids restart at each document, the first token of each is
not predicted), one row a step, the same rows in the same order for every stack.

Each stack runs in a fresh process (``--stack``: Liger-Kernel patches classes), from the same seed:
the model (a registry shape with the byte vocabulary, random weights), LoRA on every linear layer,
AdamW as Trainer sets it up by default (no weight decay, its linear schedule, gradients clipped to
norm 1.0) with a warm-up of 10 % of the steps (at a constant rate, unclipped, the curves spiked
midway and the stacks parted by the spikes), gradient checkpointing. ``stock`` is transformers + peft; ``liger`` applies Liger-Kernel's
patches before peft; ``unsloth`` loads stock's base weights through Unsloth's ``FastLanguageModel``
with its own LoRA, checkpointing and per-document attention (where it is installed and a GPU is
here; else its row is skipped and says why); ``user`` is ``optim.enable(model)`` with its defaults;
``stock-reseeded`` is the floor (``FLOOR``): stock with its adapters drawn from another seed. Each gives one
``convergence`` row: the loss at every step, the held-out loss every ``--eval-every`` steps and at
the end, the step time and the peak memory, and the largest gap of its curves from stock's.

    python -m harness.bench.convergence --model qwen3-0.6b-4l --steps 300 --seq-len 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

STACKS = ("stock", "stock-reseeded", "liger", "unsloth", "user")
# the floor: stock again, its LoRA adapters drawn from another seed (the base weights, data and
# order are stock's). Two equally valid runs part by its gaps; a stack's gap within them is not a
# difference the curves can show.
FLOOR = "stock-reseeded"
EOS = 256
VOCAB = 320  # 256 bytes, the end of a document, and room to a multiple of 64
HELD_OUT_EVERY = 20


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files in sorted order (installed packages left out)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def corpus(max_bytes: int, root: Path | None = None, shuffle_seed: int | None = None
           ) -> tuple[list[list[int]], list[list[int]], dict]:
    """(training documents, held-out documents, what the corpus is): each document a file's bytes
    and EOS; every ``HELD_OUT_EVERY``-th file held out; files in sorted order until ``max_bytes``.
    With ``shuffle_seed`` the training documents are shuffled by it (else they keep path order,
    where a run of alike modules moves the loss)."""
    train, held, digest, n, size = [], [], hashlib.sha256(), 0, 0
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(root):
        data = path.read_bytes()
        if not data.strip():
            continue
        if size + len(data) > max_bytes:
            break
        digest.update(str(path.relative_to(root)).encode() + b"\0" + data)
        (held if n % HELD_OUT_EVERY == 0 else train).append([*data, EOS])  # of the files kept
        n, size = n + 1, size + len(data)
    if not train or not held:
        raise RuntimeError(f"the standard library under {root} gave {len(train)} training and {len(held)} "
                           "held-out files: too few to train on")
    if shuffle_seed is not None:
        import random

        random.Random(shuffle_seed).shuffle(train)
    info = {"source": "python stdlib .py files", "shuffle_seed": shuffle_seed, "python": sys.version.split()[0], "files": n, "bytes": size,
            "held_out_files": len(held), "held_out_every": HELD_OUT_EVERY, "sha256": digest.hexdigest()[:16]}
    return train, held, info


def pack(docs: list[list[int]], seq_len: int, rows: int) -> list[dict]:
    """``rows`` packed rows of at most ``seq_len`` tokens, documents cut to ``seq_len`` and taken in
    order (cycling the corpus if it runs out), each row collated as stock transformers collates
    a packed batch (``DataCollatorWithFlattening``: input_ids, position_ids, labels)."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_tensors="pt")
    pieces = [d[i:i + seq_len] for d in docs for i in range(0, len(d), seq_len) if len(d[i:i + seq_len]) > 1]
    out, row, used, k = [], [], 0, 0
    while len(out) < rows:
        piece = pieces[k % len(pieces)]
        k += 1
        if used + len(piece) > seq_len:
            out.append(collate([{"input_ids": p} for p in row]))
            row, used = [], 0
        row.append(piece)
        used += len(piece)
    return out


def _build(model_name: str, stack: str, device, dtype, lora_rank: int, seed: int, adapter_seed: int | None = None,
           seq_len: int = 4096):
    import torch

    from harness.run import peers
    from harness.workload import models

    spec = dataclasses.replace(models.get(model_name), vocab_size=VOCAB, name=f"{model_name}-bytes")
    if stack == "unsloth":
        return _build_unsloth(spec, device, dtype, lora_rank, seed, adapter_seed, seq_len), spec, None
    before = peers.liger_patch(device) if stack == "liger" else None
    if stack == FLOOR or adapter_seed is not None:  # called on the bare model, just before peft draws the adapters
        draw = adapter_seed if adapter_seed is not None else seed + 1
        liger = before

        def before(model, draw=draw):
            if liger is not None:
                liger(model)
            torch.manual_seed(draw)
    model = models.build(spec, device=device, dtype=dtype, attn_implementation="sdpa", lora_rank=lora_rank,
                         seed=seed, before_lora=before)
    _train_vocab(model)
    enabled = None
    if stack == "user":
        import optim

        optim.enable(model)
        enabled = optim.enabled(model)
    torch.manual_seed(seed)
    return model, spec, enabled


def _train_vocab(model) -> None:
    """The byte vocabulary is new to the model: its embedding and lm_head train in full (small at
    VOCAB rows), as when a vocabulary is added in fine-tuning; LoRA adapts every linear layer."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        module.weight.requires_grad_(True)


def _build_unsloth(spec, device, dtype, lora_rank: int, seed: int, adapter_seed: int | None, seq_len: int):
    """Unsloth's model from stock's base weights (the same seed, drawn on the same device), its
    adapters from its own ``random_state`` (the adapter seed, else ``seed``): its LoRA draws them
    in another order than peft's, so they differ from stock's as the floor's do."""
    import torch

    from harness.run import unsloth_stack
    from harness.workload import models

    unsloth_stack.check(spec, device=device, lora_rank=lora_rank, max_seq_length=seq_len)
    base = models.build(spec, device=device, dtype=dtype, attn_implementation="sdpa", lora_rank=None,
                        gradient_checkpointing=False, seed=seed)
    try:
        model = unsloth_stack.build(spec, device=device, dtype=dtype, lora_rank=lora_rank, max_seq_length=seq_len,
                                    gradient_checkpointing=True, seed=seed if adapter_seed is None else adapter_seed,
                                    base=base)
    finally:
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _train_vocab(model)
    torch.manual_seed(seed)
    return model


def segment_lengths(position_ids) -> list[int]:
    """A packed row's document lengths, read from its position ids (each document restarts at 0)
    as optim.packing reads them."""
    from optim.packing import PackedMetadata

    return list(PackedMetadata.from_position_ids(position_ids).lengths[0])


def _inputs(stack: str, batch: dict, device) -> dict:
    """The model's keyword arguments for one collated row: Unsloth also takes the row's document
    lengths (``packed_seq_lengths``, host int32), as its packing collator hands them over."""
    out = {k: v.to(device) for k, v in batch.items()}
    if stack == "unsloth":
        from harness.run import unsloth_stack

        out.update(unsloth_stack.lengths_kwargs(segment_lengths(batch["position_ids"])), use_cache=False)
    return out


def _held_out_loss(model, rows: list[dict], device, stack: str = "stock") -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in rows:
            b = _inputs(stack, b, device)
            n = int((b["labels"][:, 1:] != -100).sum())
            total += float(model(**b).loss) * n
            count += n
    model.train()
    return total / count


def train(stack: str, *, model: str, steps: int, seq_len: int, lora_rank: int, lr: float, eval_every: int,
          eval_rows: int, corpus_mib: float, seed: int = 0, shuffle_seed: int | None = None,
          adapter_seed: int | None = None, schedule: str = "linear", warmup_frac: float = 0.1,
          max_grad_norm: float = 1.0) -> dict:
    """One stack, in this process: its ``convergence`` row (without env or command)."""
    import torch

    from harness.measure.timing import percentiles
    from harness.run import peers

    base = {"kind": "convergence", "model": model, "mode": stack, "seq_len": seq_len, "lora_rank": lora_rank,
            "lr": lr, "steps": steps, "eval_every": eval_every, "vocab_size": VOCAB, "ln_vocab": math.log(VOCAB),
            "adapter_seed": adapter_seed, "schedule": schedule, "max_grad_norm": max_grad_norm or None,
            "warmup_steps": warmup_steps(schedule, warmup_frac, steps), "weight_decay": WEIGHT_DECAY}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base.update(device_type=device.type, dtype=str(dtype).removeprefix("torch."))
    train_docs, held_docs, info = corpus(int(corpus_mib * 2**20), shuffle_seed=shuffle_seed)
    base["corpus"] = info
    try:
        net, spec, enabled = _build(model, stack, device, dtype, lora_rank, seed, adapter_seed, seq_len)
    except peers.PeerUnavailable as e:
        return {**base, "status": "skipped", "message": str(e)}
    rows = pack(train_docs, seq_len, steps)
    held = pack(held_docs, seq_len, eval_rows)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")
    sched = scheduler(opt, schedule, base["warmup_steps"], steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, held_out, step_ms, grad_norms, lrs = [], [], [], [], []
    trained_tokens = sum(int(b["input_ids"].numel()) for b in rows)
    started = time.perf_counter()
    for i, batch in enumerate(rows):
        if i % eval_every == 0:
            held_out.append([i, _held_out_loss(net, held, device, stack)])
        batch = _inputs(stack, batch, device)
        t0 = time.perf_counter()
        loss = net(**batch).loss
        loss.backward()
        if max_grad_norm:
            grad_norms.append(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # syncs: the step's time ends here
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if not math.isfinite(losses[-1]):
            return {**base, "status": "error", "message": f"the loss is {losses[-1]} at step {i}", "losses": losses}
    held_out.append([steps, _held_out_loss(net, held, device, stack)])
    p = percentiles(step_ms[min(10, steps // 2):])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    if enabled is not None:  # what ran, after the steps: the fused loss's and packed attention's calls
        import optim

        enabled = optim.enabled(net)
    return {**base, "status": "ok", "message": "", "losses": losses, "held_out": held_out,
            "grad_norms": [round(float(g), 4) for g in grad_norms] or None, "lrs": lrs,
            "trained_tokens": trained_tokens, "eval_rows": eval_rows, "smooth_steps": SMOOTH,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]), "final_held_out": held_out[-1][1],
            "ms": p["p50"], "ms_p20": p["p20"], "ms_p80": p["p80"], "peak_gib": peak,
            "wall_s": round(time.perf_counter() - started, 1), "optim": enabled,
            "model_shape": {"hidden_size": spec.hidden_size, "layers": spec.num_hidden_layers}}


SCHEDULES = ("linear", "constant")


WEIGHT_DECAY = 0.0  # Trainer's default (torch's AdamW would decay by 0.01)


def warmup_steps(schedule: str, warmup_frac: float, steps: int) -> int:
    """Warm-up steps as Trainer counts a ratio of the steps (rounded up)."""
    return 0 if schedule == "constant" else math.ceil(warmup_frac * steps)


def scheduler(opt, schedule: str, warmup: int, steps: int):
    """``linear``: transformers' ``get_linear_schedule_with_warmup``, Trainer's default; ``constant``
    keeps the rate at every step."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    if schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    return get_linear_schedule_with_warmup(opt, warmup, steps)


def gaps(row: dict, stock: dict) -> dict:
    """The largest relative gap of ``row``'s per-step loss (smoothed over ``SMOOTH`` steps, as a
    single bf16 step's loss is noisy) and of its held-out losses from stock's."""
    def smooth(xs):
        return [sum(xs[max(0, i - SMOOTH + 1):i + 1]) / len(xs[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(xs))]

    a, b = smooth(row["losses"]), smooth(stock["losses"])
    curve = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    held = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(row["held_out"], stock["held_out"]))
    first = abs(row["losses"][0] - stock["losses"][0]) / abs(stock["losses"][0])
    return {"max_rel_gap_curve": curve, "max_rel_gap_held_out": held, "rel_gap_first_step": first}


SMOOTH = 10


def run(stacks: list[str], args) -> list[dict]:
    """Each stack in a fresh process (once per adapter seed, where given), then the gaps from
    stock's curves of the same seed."""
    rows = []
    seeds = getattr(args, "adapter_seeds", None) or [None]
    for adapter_seed in seeds:
        for stack in stacks:
            rows.append(_one(stack, args, adapter_seed))
    for adapter_seed in seeds:
        mine = [r for r in rows if r.get("adapter_seed") == adapter_seed]
        stock = next((r for r in mine if r["mode"] == "stock" and r["status"] == "ok"), None)
        for r in mine:
            if stock is not None and r["status"] == "ok" and r is not stock:
                r.update(gaps(r, stock))
    return rows


def settings(args) -> dict:
    """The run's settings as its rows record them, for a row whose process left none."""
    return {"kind": "convergence", "model": args.model, "seq_len": args.seq_len, "lora_rank": args.lora_rank,
            "lr": args.lr, "steps": args.steps, "eval_every": args.eval_every, "vocab_size": VOCAB,
            "schedule": args.schedule, "max_grad_norm": args.max_grad_norm or None,
            "warmup_steps": warmup_steps(args.schedule, args.warmup_frac, args.steps), "weight_decay": WEIGHT_DECAY,
            "corpus": corpus(int(args.corpus_mib * 2**20), shuffle_seed=args.shuffle_seed)[2]}


def _one(stack: str, args, adapter_seed: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "harness.bench.convergence", "--one", stack, "--row-out", str(out),
               "--model", args.model, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--lora-rank", str(args.lora_rank), "--lr", str(args.lr), "--eval-every", str(args.eval_every),
               "--eval-rows", str(args.eval_rows), "--corpus-mib", str(args.corpus_mib),
               "--schedule", args.schedule, "--warmup-frac", str(args.warmup_frac),
               "--max-grad-norm", str(args.max_grad_norm),
               *(["--shuffle-seed", str(args.shuffle_seed)] if args.shuffle_seed is not None else []),
               *(["--adapter-seeds", str(adapter_seed)] if adapter_seed is not None else [])]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(done.stderr)
        if done.returncode != 0 or not out.is_file():
            tail = " | ".join(line for line in done.stderr.strip().splitlines()[-3:])
            return {**settings(args), "mode": stack, "adapter_seed": adapter_seed, "status": "error",
                    "message": f"the {stack} process exited with {done.returncode}: {tail}"}
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    from harness.bench import add_store_arguments, store

    ap = argparse.ArgumentParser(prog="python -m harness.bench.convergence", description=__doc__.split("\n\n")[0])
    add_store_arguments(ap, "convergence")
    ap.add_argument("--model", default="qwen3-0.6b-4l", help="a registry shape, given the byte vocabulary")
    ap.add_argument("--stacks", nargs="+", default=None, choices=STACKS, help=f"default: {' '.join(STACKS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens (bytes) per step: one packed row")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    ap.add_argument("--schedule", choices=SCHEDULES, default="linear",
                    help="linear: Trainer's default (warm-up, then linear decay to zero); constant: lr at every step")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up steps, as a fraction of --steps (linear)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the gradients' total norm to this, as Trainer does by default (0: no clipping)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-rows", type=int, default=8, help="held-out rows of --seq-len tokens")
    ap.add_argument("--corpus-mib", type=float, default=8.0)
    ap.add_argument("--shuffle-seed", type=int, default=None,
                    help="shuffle the training documents with this seed (default: the corpus's path order)")
    ap.add_argument("--adapter-seeds", type=int, nargs="+", default=None,
                    help="train every stack once per seed, its LoRA adapters drawn from that seed (the base "
                         "weights stay seed 0's); the seeds are the floor, so the floor stack is not run")
    ap.add_argument("--one", choices=STACKS, help=argparse.SUPPRESS)  # one stack, in this process
    ap.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.seq_len < 2 or args.eval_every < 1:
        ap.error("--steps and --eval-every must be at least 1, --seq-len at least 2")
    if not 0 <= args.warmup_frac < 1 or args.max_grad_norm < 0:
        ap.error("--warmup-frac must lie in [0, 1) and --max-grad-norm be at least 0")
    if args.one:
        if args.one == "unsloth":  # before anything imports torch, which it patches
            from harness.run import unsloth_stack

            unsloth_stack.import_first()
        row = train(args.one, model=args.model, steps=args.steps, seq_len=args.seq_len, lora_rank=args.lora_rank,
                    lr=args.lr, eval_every=args.eval_every, eval_rows=args.eval_rows, corpus_mib=args.corpus_mib,
                    shuffle_seed=args.shuffle_seed, adapter_seed=(args.adapter_seeds or [None])[0],
                    schedule=args.schedule, warmup_frac=args.warmup_frac, max_grad_norm=args.max_grad_norm)
        args.row_out.write_text(json.dumps(row))
        return 0
    if args.adapter_seeds and FLOOR in (args.stacks or ()):
        ap.error(f"--adapter-seeds: the seeds are the floor; drop {FLOOR} from --stacks")
    stacks = args.stacks or [s for s in STACKS if not (args.adapter_seeds and s == FLOOR)]
    rows = run(stacks, args)
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['mode']:6s} {r['status']}: {r['message']}")
            continue
        print(f"{r['mode']:6s}" + (f" seed {r['adapter_seed']}" if r.get("adapter_seed") is not None else "")
              + f" loss {r['losses'][0]:.3f} -> {r['final_loss']:.3f}, held-out "
              f"{r['held_out'][0][1]:.3f} -> {r['final_held_out']:.3f} (ln V {r['ln_vocab']:.3f}), "
              f"{r['ms']:.1f} ms/step" + (f", curve gap vs stock {r['max_rel_gap_curve']:.4f}, held-out "
                                         f"{r['max_rel_gap_held_out']:.4f}" if "max_rel_gap_curve" in r else ""))
    from harness.measure import env as envmod

    path = store(args, rows, envmod.collect(), "harness.bench.convergence", argv)
    print(f"stored {len(rows)} rows in {path}")
    failed = [r["mode"] for r in rows if r["status"] == "error"]
    if failed:
        print(f"error: {', '.join(failed)} did not train (see their rows' message)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
