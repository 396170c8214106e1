"""``transformers.Trainer`` side by side, each run in a fresh process: stock Trainer + peft, the peers a Trainer
user runs instead (every decoder layer ``torch.compile``'d; ``use_liger_kernel=True``; Unsloth's
``FastLanguageModel`` with its own LoRA and offloaded checkpointing, under Trainer and under TRL's
``SFTTrainer`` as Unsloth runs it, ``unsloth-sft``), each of the five also without
checkpointing (``-nockpt``: a user whose model fits turns it off), the same
Trainer after ``optim.enable(model)`` with ``optim.packing.PackingCollator``, and
``optim.trainer.GraphedTrainer`` (each micro-step's forward, loss and backward replayed as one
CUDA graph), on the same generated documents with the same seed. A fresh process per run keeps
what one stack leaves behind (Liger-Kernel's module-wide patches, compiled code, the allocator's
cache) from the next, and makes an OOM or a crash that run's row; Unsloth's process imports it
first, as its documentation asks. A peer that cannot run here (Liger-Kernel or Unsloth off CUDA or
not installed) gets a ``skipped`` row that says why.

Each run gives one ``trainer`` row: the median optimizer-step time after warm-up with p20/p80
(CUDA events in a Trainer callback), the peak memory, the per-step losses, and the largest
relative difference of its losses from the stock run's (the runs see the same documents per step,
so their loss curves agree within bf16 tolerance).

    python -m harness.bench.trainer --model gpt-oss-20b --max-length 2048 --doc-len 1024 \\
        --lora-rank 64 --steps 30 --warmup 10 --experiment user-moe
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from harness.bench import add_store_arguments, store
from harness.measure.timing import percentiles
from harness.run.peers import PeerUnavailable
from harness.workload import models
from harness.workload.trainers import trainer_run, unsloth_sft_run

# what a Trainer user runs instead of optim: each peer with checkpointing, and without it (as a user
# whose model fits runs it; optim.enable skips the recomputes that fit, so a peer gets the same chance)
PEERS = ("stock", "compiled", "liger", "unsloth", "unsloth-sft", "stock-nockpt", "compiled-nockpt", "liger-nockpt",
         "unsloth-nockpt", "unsloth-sft-nockpt")
RUNS = ["stock", "compiled", "ours", "graphed", "liger", "unsloth", "unsloth-sft", "stock-nockpt", "compiled-nockpt",
        "liger-nockpt", "unsloth-nockpt", "unsloth-sft-nockpt"]
SFT = "unsloth-sft"  # TRL's SFTTrainer as Unsloth runs it, not transformers.Trainer
NOCKPT = "-nockpt"


def documents(n: int, vocab_size: int, doc_len: int, seed: int = 0) -> list[dict]:
    """``n`` documents of ``doc_len`` tokens, labels = inputs (the Trainer shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, vocab_size, (doc_len,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def _one(cfg: dict) -> dict:
    """One run (``cfg["name"]``) in this process: its losses, step times, peak and what optim
    applied, or ``{"status": "skipped", "error": ...}`` where the peer cannot run here."""
    name, model, device = cfg["name"], cfg["model"], cfg["device"]
    spec = models.get(model)
    per_step = max(1, cfg["max_length"] // cfg["doc_len"])  # documents per optimizer step: one packed row
    docs = documents(cfg["steps"] * per_step, spec.vocab_size, cfg["doc_len"])
    with tempfile.TemporaryDirectory() as out_dir:
        kw = dict(steps=cfg["steps"], batch_size=per_step, docs=docs, max_length=cfg["max_length"], device=device,
                  dtype=torch.bfloat16 if device == "cuda" else torch.float32, lora_rank=cfg["lora_rank"],
                  out_dir=out_dir, warmup=cfg["warmup"], attn_implementation=cfg["attn_implementation"],
                  experts_implementation=cfg["experts_implementation"], logging_steps=cfg["logging_steps"],
                  trainer_args=cfg["trainer_args"], profile=_profile(cfg), weights_dir=cfg.get("weights_dir"))
        try:
            if name.removesuffix(NOCKPT) == SFT:
                r = unsloth_sft_run(model, gradient_checkpointing=not name.endswith(NOCKPT),
                                    **{k: v for k, v in kw.items() if k not in ("attn_implementation",
                                                                                "experts_implementation")})
            elif name in PEERS:
                peer = name.removesuffix(NOCKPT)
                r = trainer_run(model, ours=False, peer=None if peer == "stock" else peer,
                                gradient_checkpointing=not name.endswith(NOCKPT), **kw)
            else:  # as a user: optim.enable with its defaults on the model as loaded (stock attention)
                r = trainer_run(model, ours=True, rows=1, graphed=name == "graphed", **kw)
        except PeerUnavailable as e:
            return {"status": "skipped", "error": str(e)}
    return {"status": "ok", "losses": r["losses"], "step_ms_all": r["step_ms_all"],
            "issue_ms_all": r.get("issue_ms_all"), "gc_collections_all": r.get("gc_collections_all"),
            "peak_gib": r["peak_gib"],
            "enabled": r.get("enabled"), "recompute_stats": r.get("recompute_stats"),
            "gradient_checkpointing": r.get("gradient_checkpointing"),
            "attn_implementation_used": r.get("attn_implementation_used"), "batching": r.get("batching"),
            "weights": r.get("weights")}


def _per_step(per_step: list | None, warmup: int) -> list[float] | None:
    """The mean per timed step of each generation's collections, None where the run kept none."""
    timed = (per_step or [])[warmup:]
    return [round(sum(s[g] for s in timed) / len(timed), 2) for g in range(len(timed[0]))] if timed else None


def profile_stem(model: str, max_length: int, name: str) -> str:
    """The file name stem of a run's profile under --profile's folder."""
    return f"trainer-{model}-{max_length}-{name}"


def _profile(cfg: dict) -> dict | None:
    p = cfg.get("profile")
    if not p:
        return None
    stem = profile_stem(cfg["model"], cfg["max_length"], cfg["name"])
    summary = {"model": cfg["model"], "seq_len": cfg["max_length"], "variant": f"Trainer {cfg['name']}"}
    return {"out_dir": p["out"], "stem": stem, "start": cfg["warmup"], "steps": p["steps"],
            "trace": p.get("trace", False), "host": p.get("host", False), "summary": summary}


def child(cfg_path: str, out_path: str) -> int:
    """One run in this process (``python -m harness _trainer_run``, which imports Unsloth first for
    its runs), its result written as JSON (an out-of-memory error is a result)."""
    from harness.measure import env as envmod

    cfg = json.loads(Path(cfg_path).read_text())
    try:
        out = _one(cfg)
    except torch.OutOfMemoryError as e:
        out = {"status": "oom", "error": str(e).splitlines()[0] if str(e) else "out of memory"}
    out["env"] = envmod.collect()  # the process that measured: the parent makes no CUDA context
    Path(out_path).write_text(json.dumps(out, default=str))
    return 0


def _isolated(cfg: dict, timeout_s: float | None = None) -> dict:
    """One run in a fresh process, as the sweep runs each point: no compiled code, Liger-Kernel
    patch or allocator state of an earlier run under it, and a crash, an OOM (the GPU's or the
    host's) or a run past ``timeout_s`` is that run's row. Its output passes through; a process that
    wrote no result gets the sweep's reading of its death (``launchers.death``) and its output's
    tail. Interrupted (Ctrl-C, SIGTERM), the run's process goes down with this one."""
    from harness.measure import host
    from harness.measure.env import REPO_ROOT
    from harness.run.launchers import Child, death

    with tempfile.TemporaryDirectory(prefix="packbench-trainer-") as tmp:
        cfg_path, out_path = Path(tmp, "run.json"), Path(tmp, "result.json")
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        tail: collections.deque = collections.deque(maxlen=40)
        timed_out = False
        with host.Watch() as watch, _sigterm_raises():
            proc = subprocess.Popen([sys.executable, "-u", "-m", "harness", "_trainer_run",
                                     str(cfg_path), str(out_path)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
            # its own process group, killed whole: compile workers it started would hold the pipe open
            child = Child(proc.pid, proc.stdout, lambda t: proc.wait(timeout=t))
            fired = threading.Event()

            def expire() -> None:
                fired.set()
                child.kill()

            timer = threading.Timer(timeout_s, expire) if timeout_s else None
            try:
                if timer:
                    timer.start()
                for line in proc.stdout:
                    print(line, end="", flush=True)
                    tail.append(line)
                code = proc.wait()
                timed_out = fired.is_set()
            except BaseException:
                child.kill()
                proc.wait()
                raise
            finally:
                if timer:
                    timer.cancel()
        try:
            out = json.loads(out_path.read_text())
        except (OSError, ValueError):
            out = None
    if out is None:
        text = "".join(tail)
        status, why, bound = death(code, timed_out, text, watch.oom_killed, timeout_s, "run")
        out = {"status": status, "error": why, "log_tail": text[-1500:]}
        if bound:
            out["memory_bound"] = bound
    if watch.peak_gib is not None:
        out["host_used_peak_gib"] = round(watch.peak_gib, 2)
    return out


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (a scheduler, ``timeout``) raises SystemExit here, so the run's process is killed
    with this one instead of left holding the GPU; only where this is the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(model: str, runs: list[str], *, max_length: int, doc_len: int, lora_rank: int, steps: int,
        warmup: int, device: str, attn_implementation: str, experts_implementation: str | None,
        logging_steps: int | None = None, trainer_args: dict | None = None, on_row=None,
        timeout_s: float | None = None, profile: dict | None = None) -> list[dict]:
    """Each run's row, in ``RUNS`` order, each run in a fresh process; ``on_row(row, env)`` is called
    as each one is made, with the environment its process recorded (the CLI stores it then, so a
    bench killed later keeps the rows before it). A process that recorded none (it died) gets the
    last run's, else what this process reads without a CUDA context (``env.light`` and the GPU's
    name from NVML). ``profile`` (``{"out": folder, "steps": n, "trace": bool}``) profiles each
    run's ``n`` optimizer steps after the warm-up (``harness.run.profile.trainer_profiler``); their
    times are the profiler's, so such rows are not for storing. The Unsloth runs share one folder of
    stock's saved weights (``trainers.unsloth_weights``), removed when the last run is done: the
    first writes them, the later ones only read."""
    rows, results, env = [], {}, None
    if logging_steps is None:  # Trainer's own default, recorded as the number it is
        from transformers import TrainingArguments

        logging_steps = TrainingArguments.__dataclass_fields__["logging_steps"].default
    trainer_args = dict(sorted(trainer_args.items())) if trainer_args else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_raises())  # SIGTERM between runs still removes the folder
        weights_dir = None
        if any(n.startswith("unsloth") for n in runs):
            _drop_stale_weights()
            weights_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{WEIGHTS_PREFIX}{os.getpid()}-"))
        for name in sorted(runs, key=RUNS.index):
            base = {"kind": "trainer", "model": model, "mode": name, "tokens": max_length, "doc_len": doc_len,
                    "lora_rank": lora_rank, "steps": steps, "warmup": warmup, "device_type": device,
                    "attn_implementation": attn_implementation, "experts_implementation": experts_implementation,
                    "logging_steps": logging_steps, "trainer_args": trainer_args}
            cfg = {"name": name, "model": model, "max_length": max_length, "doc_len": doc_len,
                   "lora_rank": lora_rank, "steps": steps, "warmup": warmup, "device": device,
                   "attn_implementation": attn_implementation, "experts_implementation": experts_implementation,
                   "logging_steps": logging_steps, "trainer_args": trainer_args, "profile": profile,
                   "stack": "unsloth" if name.startswith("unsloth") else None, "weights_dir": weights_dir}
            r = _isolated(cfg, timeout_s)
            rows.append(_row(base, r, results, warmup))
            env = r.get("env") or env or _env_without_cuda(device)
            if on_row is not None:
                on_row(rows[-1], env)
    return rows


WEIGHTS_PREFIX = "packbench-weights-"  # then the bench's pid: the temporary folder its Unsloth runs share


def _drop_stale_weights(root: str | None = None) -> None:
    """Remove the weights folders (``WEIGHTS_PREFIX``) of benches whose process is gone: one killed
    outright (SIGKILL) leaves its folder, a 20B model's 40 GB, which would leave the next bench no
    room to hand stock's weights over."""
    import shutil

    for folder in Path(root or tempfile.gettempdir()).glob(f"{WEIGHTS_PREFIX}*"):
        pid = folder.name.removeprefix(WEIGHTS_PREFIX).split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # gone
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _row(base: dict, r: dict, results: dict, warmup: int) -> dict:
    """A run's row from its process's result ``r``, its loss compared with the stock run's where
    that ran first; an ok result is kept in ``results`` under the run's name."""
    model, name = base["model"], base["mode"]
    if r.get("status") != "ok":
        print(f"{model} {name:8s} {r.get('status')}: {r.get('error')}", flush=True)
        return {**base, **{k: r[k] for k in ("status", "error", "log_tail", "memory_bound", "host_used_peak_gib")
                           if k in r}}
    results[name] = r
    p = percentiles(r["step_ms_all"][warmup:])
    ref = results.get("stock")
    diff = None
    if ref is not None and len(ref["losses"]) == len(r["losses"]):
        diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"])), default=None)
    issue = percentiles(r["issue_ms_all"][warmup:]) if r.get("issue_ms_all") else None
    print(f"{model} {name:8s} {p['p50']:8.1f} ms [{p['p20']:.1f}-{p['p80']:.1f}]  "
          + (f"host {issue['p50']:.1f} ms  " if issue else "")
          + f"peak {r['peak_gib'] or 0:.2f} GiB  loss diff vs stock {diff if diff is not None else '-'}", flush=True)
    return {**base, "status": "ok", "ms": p["p50"], "ms_p20": p["p20"], "ms_p80": p["p80"],
            "ms_samples": p["samples"],
            # the host's time per step, begin to end callback: a step time that follows it is host-bound
            "issue_ms": issue["p50"] if issue else None, "issue_ms_samples": issue["samples"] if issue else None,
            # Python's cycle collections in each timed step, by generation (the collector as the run left it)
            "gc_collections_per_step": _per_step(r.get("gc_collections_all"), warmup),
            "peak_gib": r["peak_gib"], "losses": r["losses"],
            "host_used_peak_gib": r.get("host_used_peak_gib"),
            "max_rel_loss_diff_vs_stock": diff, "gradient_checkpointing": r.get("gradient_checkpointing"),
            "attn_implementation_used": r.get("attn_implementation_used"), "batching": r.get("batching"),
            "weights": r.get("weights"),  # "stock": built from stock's weights, Unsloth's too
            "optim": r.get("enabled") if name not in PEERS else None,
            "recompute_stats": r.get("recompute_stats") if name not in PEERS else None}


def _env_without_cuda(device: str) -> dict:
    from harness.measure import env as envmod
    from harness.run.sweep import detect_device_name

    from harness.errors import InputError

    try:
        name = detect_device_name(device)
    except InputError:  # CUDA without NVML to name it
        name = device
    return {**envmod.light(), "device_name": name}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.trainer", description=__doc__.split("\n\n")[0])
    add_store_arguments(ap, "user-moe")
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per optimizer step (one packed row)")
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--attn-implementation", default="flex_attention",
                    help="the stock attention the model is loaded with (every run)")
    ap.add_argument("--experts-implementation", default="grouped_mm")
    ap.add_argument("--logging-steps", type=int, default=None,
                    help="Trainer's logging_steps (default: Trainer's own, 500); each log reads the loss and "
                         "gradient norm with host syncs, so 1 adds them to every step")
    ap.add_argument("--trainer-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="one more TrainingArguments field for every run, VALUE read as JSON where it parses "
                         "(logging_nan_inf_filter=false); recorded on the rows")
    ap.add_argument("--timeout-s", type=float, default=3600.0,
                    help="a run's process still running after this many seconds is killed, and its row says so")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile each run's optimizer steps after the warm-up (Trainer's phases, the top "
                         "kernels and CPU ops, as `harness profile` writes them) into DIR instead of storing "
                         "rows: the profiler slows the steps it records")
    ap.add_argument("--profile-steps", type=int, default=3, help="optimizer steps profiled (default: 3)")
    ap.add_argument("--trace", action="store_true", help="with --profile, also write each run's chrome trace")
    ap.add_argument("--host", action="store_true",
                    help="with --profile, profile the host side with cProfile instead (<run>.host.txt: Python "
                         "functions' own and cumulative time per step, a wait on a sync in the call that waits), "
                         "to read beside tools/user_loop.py --host-profile")
    args = ap.parse_args(argv)
    trainer_args = {}
    for item in args.trainer_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--trainer-arg takes KEY=VALUE, got {item!r}")
        try:
            trainer_args[key] = json.loads(value)
        except json.JSONDecodeError:
            trainer_args[key] = value
    try:
        models.get(args.model)
    except KeyError:
        ap.error(f"unknown model {args.model!r} (known: {', '.join(models.names())})")
    # what the runs' processes will see (is_available makes no CUDA context: each run has the GPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "graphed" in args.runs and device != "cuda":
        ap.error("the graphed run needs CUDA")
    if args.profile is not None and (args.profile_steps < 1 or args.warmup + args.profile_steps > args.steps):
        ap.error(f"--profile-steps must be 1..{args.steps - args.warmup} (the steps after --warmup {args.warmup})")
    if (args.trace or args.host) and args.profile is None:
        ap.error("--trace and --host go with --profile DIR")
    if args.trace and args.host:
        ap.error("--trace is torch.profiler's; --host profiles with cProfile, which writes no trace")
    profile = None if args.profile is None else {"out": str(args.profile.resolve()), "steps": args.profile_steps,
                                                 "trace": args.trace, "host": args.host}
    paths = set()
    on_row = None if profile else (lambda row, env: paths.add(store(args, [row], env, "harness.bench.trainer", argv)))
    rows = run(args.model, args.runs, max_length=args.max_length, doc_len=args.doc_len, lora_rank=args.lora_rank,
               steps=args.steps, warmup=args.warmup, device=device, attn_implementation=args.attn_implementation,
               experts_implementation=args.experts_implementation, logging_steps=args.logging_steps,
               trainer_args=trainer_args, timeout_s=args.timeout_s, on_row=on_row, profile=profile)
    if profile:
        missing = [r["mode"] for r in rows
                   if not (args.profile / f"{profile_stem(args.model, args.max_length, r['mode'])}.summary.json").exists()]
        print(f"\nprofiles in {args.profile}; {len(rows)} rows not stored (their steps ran under the profiler)"
              + (f"; no profile from {', '.join(missing)}" if missing else ""))
    else:
        print(f"\nstored {len(rows)} rows in {', '.join(map(str, sorted(paths)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
