"""Profile one training step of a sweep point: where the step's time goes.

    python -m harness profile experiments/moe.toml --model gpt-oss-20b --seq-len 2048 \\
        --variant grouped_mm-split --out profiles/

The point is built exactly as a sweep builds it (same model, switches, data and loss), warmed
up, and then ``--steps`` steps run under ``torch.profiler``. Written to ``--out``:

- ``<point>.summary.json``: per phase (forward, backward, optimizer) the GPU span, the time at
  least one kernel runs (busy %), kernel launches and host syncs; the top kernels and CPU ops;
- ``<point>.kernels.txt`` / ``<point>.cpu.txt``: torch's own tables, by device time and by self
  CPU time;
- ``<point>.trace.json.gz`` with ``--trace``: the chrome trace (open in Perfetto).

A step whose phases are mostly idle GPU is bound by the host (Python, kernel launches, syncs);
one that is busy is bound by its kernels, and the kernel table says which.

With ``--out results/<experiment>/profiles/<gpu_slug>`` the experiment's report gains a section
built from the summaries: phases, and kernel time by family per step and per 1k tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from harness.measure.trace import trace_events, union

if TYPE_CHECKING:  # the CLI builds its parser from this module: torch is imported where used
    from harness.run.experiment import SweepPoint

PHASES = ("forward", "backward", "optimizer")
# The runtime calls that make the host wait for the device.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")


def _dur(e) -> float:
    return float(e.get("dur", 0.0))


def analyze(events: list[dict], phases: tuple[str, ...] = PHASES) -> dict:
    """Per phase (labelled with ``record_function("phase:<name>")``): the GPU work it launched,
    how much of that work's span the GPU was busy, the kernel launches and the host syncs.

    A kernel belongs to the phase whose CPU range holds its launch (matched by the trace's
    correlation id): the backward's kernels are launched from autograd's own thread, which the
    GPU-side annotation of the phase does not follow."""
    xs = [e for e in events if e.get("ph") == "X"]
    kernels = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    corr = lambda e: (e.get("args") or {}).get("correlation")  # noqa: E731
    launch_ts = {corr(r): float(r["ts"]) for r in runtime if corr(r) is not None}
    out: dict = {"phases": {}}
    for name in phases:
        label = f"phase:{name}"
        cpu = [(float(e["ts"]), float(e["ts"]) + _dur(e)) for e in xs
               if e.get("name") == label and e.get("cat") == "user_annotation"]
        inside = lambda t: any(a <= t <= b for a, b in cpu)  # noqa: E731
        mine = [k for k in kernels if corr(k) in launch_ts and inside(launch_ts[corr(k)])]
        ivals = [(float(k["ts"]), float(k["ts"]) + _dur(k)) for k in mine]
        span = (max(b for _, b in ivals) - min(a for a, _ in ivals)) if ivals else 0.0
        busy_us = sum(b - a for a, b in union(ivals))
        out["phases"][name] = {
            "gpu_span_ms": span / 1e3,
            "cpu_span_ms": sum(b - a for a, b in cpu) / 1e3,
            "gpu_busy_ms": busy_us / 1e3,
            "gpu_busy_pct": 100.0 * busy_us / span if span else None,
            "kernels": len(mine),
            "launches": sum(1 for r in runtime if r["name"].startswith(LAUNCH_PREFIXES) and inside(float(r["ts"]))),
            "host_syncs": sum(1 for r in runtime if r["name"] in SYNC_CALLS and inside(float(r["ts"]))),
        }
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        acc = by_kernel[k["name"]]
        acc[0] += _dur(k)
        acc[1] += 1
    total = sum(v[0] for v in by_kernel.values()) or 1.0
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    out["top_kernels"] = [{"name": n[:160], "ms": v[0] / 1e3, "count": v[1], "pct": 100 * v[0] / total}
                          for n, v in top]
    out["kernel_ms_total"] = total / 1e3
    return out


def profile_point(point: SweepPoint, out_dir: Path, *, warmup: int = 2, steps: int = 1,
                  trace: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from harness.run.point import prepare
    from harness.run.record import attention_kernels
    from harness.workload import models as model_registry

    spec = model_registry.get(point.model)
    run = prepare(point, spec, warmup + steps)
    for i in range(warmup):
        run.step(point, i)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    if "optim.packing" in run.optim_applied:
        from optim import packing

        packing.reset_counters()  # the attention kernels of the profiled steps alone
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    with _without_profiler_chatter(), profile(activities=acts) as prof:
        for i in range(warmup, warmup + steps):
            run.step(point, i, phase=lambda name: record_function(f"phase:{name}"))
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    summary = {"point_id": point.point_id, "model": point.model, "seq_len": point.seq_len,
               "variant": point.variant, "steps": steps, "device": str(run.device),
               # the host side is what a profile explains; a replayed graph has none, so a
               # cuda_graph variant is profiled as the eager steps it captures
               "profiled": "eager steps of a cuda_graph variant" if point.cuda_graph else "eager steps",
               "device_name": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
               **attention_kernels(run.model, run.optim_applied)}
    return write_profile(prof, out_dir, f"{point.model}-{point.seq_len}-{point.variant}", summary, run.device,
                         trace=trace)


def write_profile(prof, out_dir: Path, stem: str, summary: dict, device, *, trace: bool = False,
                  phases: tuple[str, ...] = PHASES) -> dict:
    """The profiler's tables, the summary (``summary`` plus ``analyze``'s phases and kernels) and,
    with ``trace``, the chrome trace, written under ``out_dir`` as ``<stem>.*``; returns the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    avg = prof.key_averages()
    (out_dir / f"{stem}.kernels.txt").write_text(avg.table(sort_by=sort, row_limit=40, max_name_column_width=90))
    (out_dir / f"{stem}.cpu.txt").write_text(avg.table(sort_by="self_cpu_time_total", row_limit=40,
                                                       max_name_column_width=90))
    from harness.measure.env import light

    events = trace_events(prof)
    # the code, commit and host that measured it, as a sweep's row records them
    summary = {**summary, "env": light(), **analyze(events, phases)}
    (out_dir / f"{stem}.summary.json").write_text(json.dumps(summary, indent=1))
    if trace:
        with gzip.open(out_dir / f"{stem}.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    return summary


TRAINER_PHASES = ("forward_backward", "optimizer", "step_end")


def trainer_profiler(out_dir: Path, stem: str, *, start: int, steps: int, summary: dict, trace: bool = False):
    """A ``TrainerCallback`` that profiles Trainer's optimizer steps ``start`` .. ``start + steps - 1``
    (0-based) as ``profile_point`` profiles a sweep point's, in Trainer's phases: its micro-steps'
    forward and backward (with gradient clipping), the optimizer step, and what runs after it
    (scheduler, zero_grad, callbacks); Trainer's logging and data loading fall between the phases,
    in the tables only. The files are written when the last profiled step ends, or when training
    ends before it (with the steps it holds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    state = {"prof": None, "phase": None, "done": False}

    def enter(name: str | None) -> None:
        if state["phase"] is not None:
            state["phase"].__exit__(None, None, None)
        state["phase"] = None
        if name is not None:
            state["phase"] = record_function(f"phase:{name}")
            state["phase"].__enter__()

    class _Profile(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if state["done"] or st.global_step < start:
                return
            if state["prof"] is None:
                if cuda:
                    torch.cuda.synchronize()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                state["prof"] = profile(activities=acts)
                state["prof"].__enter__()
            enter("forward_backward")

        def on_pre_optimizer_step(self, args, st, control, **kw):
            if state["prof"] is not None and not state["done"]:
                enter("optimizer")

        def on_optimizer_step(self, args, st, control, **kw):
            if state["prof"] is not None and not state["done"]:
                enter("step_end")

        def on_step_end(self, args, st, control, **kw):
            if state["prof"] is None or state["done"]:
                return
            enter(None)
            if st.global_step >= start + steps:
                finish(steps)

        def on_train_end(self, args, st, control, **kw):
            # training stopped before the last profiled step ended (its data ran out, a callback
            # stopped it): what was profiled is written, and says how many steps it holds
            if state["prof"] is not None and not state["done"]:
                enter(None)
                finish(max(0, st.global_step - start))

    def finish(done_steps: int) -> None:
        if cuda:
            torch.cuda.synchronize()
        state["prof"].__exit__(None, None, None)
        state["done"] = True
        device = torch.device("cuda" if cuda else "cpu")
        info = {**summary, "steps": done_steps, "profiled": "Trainer optimizer steps",
                "device_name": torch.cuda.get_device_name() if cuda else "cpu"}
        if done_steps < steps:
            info["profiled"] += f" (training ended after {done_steps} of the {steps} asked for)"
        s = write_profile(state["prof"], out_dir, stem, info, device, trace=trace, phases=TRAINER_PHASES)
        print(format_summary(s), flush=True)

    return _Profile()


def trainer_host_profiler(out_dir: Path, stem: str, *, start: int, steps: int, summary: dict):
    """A ``TrainerCallback`` that runs cProfile over Trainer's optimizer steps ``start`` .. ``start +
    steps - 1`` (0-based), from the first's begin callback to the last's end callback, and writes
    ``<stem>.host.txt`` (``harness.measure.hostprofile``) and ``<stem>.summary.json``: where a
    host-bound Trainer step's time goes, beside ``tools/user_loop.py --host-profile``'s own loop. A
    host sync inside the steps shows as time in the call that waits. The GPU is waited for before
    the first profiled step, so no earlier step's kernels are waited on inside it."""
    import cProfile
    import time

    import torch
    from transformers import TrainerCallback

    from harness.measure import hostprofile

    cuda = torch.cuda.is_available()
    state = {"prof": None, "done": False, "t0": 0.0}

    class _HostProfile(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if state["done"] or state["prof"] is not None or st.global_step < start:
                return
            if cuda:
                torch.cuda.synchronize()
            state["prof"], state["t0"] = cProfile.Profile(), time.perf_counter()
            state["prof"].enable()

        def on_step_end(self, args, st, control, **kw):
            if state["prof"] is not None and not state["done"] and st.global_step >= start + steps:
                finish(steps)

        def on_train_end(self, args, st, control, **kw):
            if state["prof"] is not None and not state["done"]:  # training ended first: what it holds
                finish(max(1, st.global_step - start))

    def finish(done_steps: int) -> None:
        state["prof"].disable()
        wall_ms = (time.perf_counter() - state["t0"]) * 1e3 / done_steps
        state["done"] = True
        out_dir.mkdir(parents=True, exist_ok=True)
        title = f"{summary.get('variant', stem)}: {done_steps} optimizer step(s) after {start}"
        per_step = hostprofile.write(state["prof"], out_dir / f"{stem}.host.txt", steps=done_steps, title=title)
        info = {**summary, "steps": done_steps, "profiled": "Trainer optimizer steps, host side (cProfile)",
                "host_ms_per_step_profiled": round(per_step, 1), "wall_ms_per_step_profiled": round(wall_ms, 1),
                "device_name": torch.cuda.get_device_name() if cuda else "cpu"}
        (out_dir / f"{stem}.summary.json").write_text(json.dumps(info, indent=1))
        print(f"host profile of {title}: {per_step:.1f} ms per step in Python functions, {wall_ms:.1f} ms wall "
              f"(both under cProfile) in {out_dir / (stem + '.host.txt')}", flush=True)

    return _HostProfile()


@contextlib.contextmanager
def _without_profiler_chatter():
    """The profiler's C++ side writes its start and stop to the process's stderr ("USDT: ...
    profiler_start"); everything else written there meanwhile is passed on as it came."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def format_summary(s: dict) -> str:
    """The phases table and the top kernels; on a CPU run, the host times alone (the CPU's own
    operators are in the .cpu.txt table beside the summary)."""
    gpu = s["device_name"] != "cpu"
    lines = [f"{s['model']} T={s['seq_len']} {s['variant']} on {s['device_name']} ({s['steps']} step(s), "
             f"{s.get('profiled', 'eager steps')})"]
    if not gpu:
        lines.append("CPU run: host times only (a GPU run adds kernel times, GPU busy %, launches and syncs)")
    w = max([10] + [len(n) for n in s["phases"]])
    lines.append(f"{'phase':{w}s} {'gpu ms':>9s} {'cpu ms':>9s} {'busy %':>7s} {'launches':>9s} {'syncs':>6s}"
                 if gpu else f"{'phase':{w}s} {'cpu ms':>9s}")
    for name, p in s["phases"].items():
        busy = f"{p['gpu_busy_pct']:.1f}" if p["gpu_busy_pct"] is not None else "-"
        lines.append(f"{name:{w}s} {p['gpu_span_ms']:9.1f} {p['cpu_span_ms']:9.1f} {busy:>7s} "
                     f"{p['launches']:9d} {p['host_syncs']:6d}" if gpu else f"{name:{w}s} {p['cpu_span_ms']:9.1f}")
    if s.get("attention_kernels"):
        kinds = ", ".join(k if n is None else f"{k} x{n}" for k, n in s["attention_kernels"].items())
        lines.append(f"attention kernels: {kinds}"
                     + (f" (fused flex fell back: {s['attention_fallback']})" if s.get("attention_fallback") else ""))
    if gpu:
        lines.append(f"top kernels (of {s['kernel_ms_total']:.1f} ms):")
        for k in s["top_kernels"][:12]:
            lines.append(f"  {k['ms']:8.2f} ms {k['pct']:5.1f}% x{k['count']:<5d} {k['name'][:100]}")
    return "\n".join(lines)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("experiment", help="experiment file (TOML)")
    ap.add_argument("--model", required=True, help="one of the file's models")
    ap.add_argument("--seq-len", type=_count(1), required=True, help="one of the file's sequence lengths")
    ap.add_argument("--variant", required=True, help="one of the file's variants")
    ap.add_argument("--out", default="profiles", type=Path, help="folder for the summary, tables and trace (default: profiles/)")
    ap.add_argument("--warmup", type=_count(0), default=2, help="unprofiled steps first (default: 2)")
    ap.add_argument("--steps", type=_count(1), default=1, help="profiled steps, at least 1 (default: 1)")
    ap.add_argument("--trace", action="store_true", help="also write the gzipped chrome trace")


def run(args) -> int:
    from harness.run import experiment as expmod

    try:
        exp = expmod.subset(expmod.load(args.experiment), models=[args.model], seq_lens=[args.seq_len],
                            variants=[args.variant])
    except expmod.ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    point = exp.points()[0]
    if point.stack == "unsloth" and "torch" not in sys.modules:
        # as a sweep point's process does: Unsloth patches torch, transformers and peft, so it
        # comes first, or its build refuses to run
        from harness.run import unsloth_stack

        unsloth_stack.import_first()
    from harness.run.peers import PeerUnavailable

    try:
        s = profile_point(point, Path(args.out), warmup=args.warmup, steps=args.steps, trace=args.trace)
    except PeerUnavailable as e:  # a peer that cannot run here: one line, as its sweep row says
        print(f"error: {point.variant}: {e}", file=sys.stderr)
        return 1
    print(format_summary(s))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.run.profile", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
