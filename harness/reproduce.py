"""``python -m harness reproduce PLAN --minutes 9``: run a report plan's steps (``[[blog.steps]]``
of ``experiments/blog.toml``) on this GPU, in order, resumably, and stop before the budget.

A sweep step is done when every point of its (cut) experiment has a finished row here; it resumes
by itself and is told to start no point after the budget minus its estimate. A bench step is done
when its experiment's results on this GPU hold a row its command wrote. A step whose
``min_gpu_gib`` is above this GPU's memory is skipped, and says so. Rerun the same command until
it prints "done"; each call ends within about ``--minutes``."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness import results as res
from harness.report.blog import plan as plan_file
from harness.run import experiment


def _gpu() -> tuple[str, float]:
    import torch

    if not torch.cuda.is_available():
        return "cpu", 0.0
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / 2**30


def _cut(step: plan_file.Step, plan_dir: Path):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--models", nargs="+")  # the sweep's own cut of the file
    ap.add_argument("--seq-lens", nargs="+", type=int)
    ap.add_argument("--variants", nargs="+")
    known, _ = ap.parse_known_args(step.args)
    exp = experiment.load(plan_dir / step.sweep)
    return experiment.subset(exp, models=known.models, seq_lens=known.seq_lens, variants=known.variants)


def pending(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> bool:
    if step.sweep:
        exp = _cut(step, plan_dir)
        done = res.finished_point_ids(res.results_path(results, exp.name, slug))
        return any(p.point_id not in done for p in exp.points())
    rows = res.read_rows(res.results_path(results, str(step.experiment), slug))
    return not any(_ran(step, str(r.get("command") or "")) for r in rows)


def _ran(step: plan_file.Step, command: str) -> bool:
    """Whether a bench row's recorded command is this step's: its module, with the step's
    arguments in order (other options, such as --results, around them)."""
    words, args = shlex.split(command), list(step.args)
    if f"harness.bench.{step.bench}" not in words:
        return False
    return not args or any(words[i:i + len(args)] == args for i in range(len(words)))


def run(plan_path: Path | str, *, minutes: float = 9.0, results: Path | str = "results", dry_run: bool = False) -> int:
    plan = plan_file.load(plan_path)
    plan_dir, results = plan.path.parent, Path(results)
    name, gib = _gpu()
    if name == "cpu" and not dry_run:
        print("error: the plan's sweeps and benches need a CUDA GPU (--dry-run lists them)", file=sys.stderr)
        return 2
    slug = res.gpu_slug(name)
    start, budget = time.monotonic(), minutes * 60
    left = []
    for step in plan.steps:
        if step.min_gpu_gib and gib < step.min_gpu_gib:
            print(f"skip {step.name}: needs a GPU of {step.min_gpu_gib:g} GiB, this one has {gib:.0f}", file=sys.stderr)
            continue
        if not pending(step, plan_dir, results, slug):
            print(f"done {step.name}", file=sys.stderr)
            continue
        remaining = budget - (time.monotonic() - start)
        if remaining < step.estimate_s:
            left.append(step.name)
            continue
        argv = [sys.executable, *step.argv(plan_dir), "--results", str(results)]
        if step.sweep:
            argv += ["--stop-after", f"{max(remaining - step.estimate_s, 0):.0f}"]
        print(f"run {step.name}: {' '.join(argv[1:])}", file=sys.stderr)
        if dry_run:
            left.append(step.name)
            continue
        rc = subprocess.run(argv).returncode
        if rc != 0:
            print(f"error: {step.name} exited {rc}; its rows so far are kept, a rerun resumes", file=sys.stderr)
            return 1
        if pending(step, plan_dir, results, slug):
            left.append(step.name)
    if dry_run:
        print(f"dry run: {len(left)} steps would run", file=sys.stderr)
        return 0
    if left:
        print(f"not finished within {minutes:g} min: {', '.join(left)}; run the same command again", file=sys.stderr)
        return 3
    print(f"done: every step of {plan.path.name} has its rows on {name}", file=sys.stderr)
    return 0
