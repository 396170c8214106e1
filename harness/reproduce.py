"""``python -m harness reproduce PLAN --minutes 9``: run a report plan's steps (``[[blog.steps]]``
of ``experiments/blog.toml``) on this GPU, in order, resumably, and stop before the budget.

A sweep step is done when every point of its (cut) experiment has a finished row here; it resumes
by itself and is told to start no point that would end past the budget by its estimate
(``results.point_estimate_s``: the point's own longest earlier wall time on this GPU type where it
has one, else half as long again as on another, else the step's ``estimate_s``). A bench step is done
when its experiment's results on this GPU hold rows its command wrote, for every model and length
it names. A context step (``python -m harness context``) is done when each of its searches is over
and ours has its probe at the best peer's longest length, read from its rows (``context.left``);
it is told to start no probe that could end past the budget. A step whose
``min_gpu_gib`` is above this GPU's memory is skipped, and says so. Rerun the same command until
it prints "done"; each call ends within about ``--minutes``. ``--status SLUG`` says what is left
on a GPU type from the rows alone, on any machine; ``--step NAME`` (repeatable) runs only those
steps, for a reader who wants one section's rows first."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness import results as res
from harness import roles
from harness.measure.env import code_id
from harness.report import runs
from harness.report.blog import plan as plan_file
from harness.run import context as context_cli
from harness.run import experiment


def _gpu() -> tuple[str, float]:
    """The first visible GPU's name and memory in GiB, read through NVML: CUDA would make a context
    in this process that holds GPU memory while the sweeps it starts run (and would move where a
    context search runs out of memory)."""
    try:
        import pynvml

        from harness.measure.env import nvml_handle

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "cpu", 0.0
            handle = nvml_handle(pynvml, 0)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            return (name.decode() if isinstance(name, bytes) else name), total / 2**30
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver: a CPU machine
        return "cpu", 0.0


def _parse_cut(step: plan_file.Step):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--models", nargs="+")  # the sweep's own cut of the file
    ap.add_argument("--seq-lens", nargs="+", type=int)
    ap.add_argument("--variants", nargs="+")
    return ap.parse_known_args(step.args)


def _cut(step: plan_file.Step, plan_dir: Path):
    known, _ = _parse_cut(step)
    exp = experiment.load(plan_dir / step.sweep)
    return experiment.subset(exp, models=known.models, seq_lens=known.seq_lens, variants=known.variants)


def _latest_finished(rows: list[dict]) -> dict[str, dict]:
    """point id -> its newest finished row (rows are appended in the order they were written)."""
    return {r["point_id"]: r for r in rows
            if res.is_finished(r) and r.get("point_id")}


def group_todo(points: list, latest: dict[str, dict], code: str | None, now: float, estimate_s: float,
               history: dict[str, float] | None = None, elsewhere: dict[str, float] | None = None):
    """What a ``together`` step still runs of one (model, length) group's side-by-side points, as
    ``(points, overwrite)``: nothing when the newest finished rows of all of them come from one run;
    the points outside the newest run when that run is this code's and recent enough that they can
    still join it (within SAME_RUN_MINUTES, each taking its own longest earlier wall time from
    ``history``, else a margin over its time on another GPU type from ``elsewhere``, else
    ``estimate_s``); else all of them again. ``overwrite`` when a point to run
    already has a row (the sweep skips it otherwise)."""
    have = [latest[p.point_id] for p in points if p.point_id in latest]
    if len(have) == len(points) and runs.from_one_run(have) is not False:
        return [], False
    newest = runs.split_runs(have)[-1] if have else []
    started = runs.recorded_at(newest[0]) if newest else None  # None: rows without a recording time
    rest = [p for p in points if p.point_id not in {r.get("point_id") for r in newest}]
    fresh = started is not None and runs.code_ids(newest) <= {code} and \
        now - started.timestamp() + sum(res.point_estimate_s(history or {}, p.point_id, estimate_s, elsewhere)
                                        for p in rest) <= runs.SAME_RUN_MINUTES * 60
    todo = rest if fresh else list(points)
    return todo, any(p.point_id in latest for p in todo)


def _groups(step: plan_file.Step, plan_dir: Path, results: Path, slug: str):
    """(experiment, [(points, overwrite)]) of a together step's groups that still have work."""
    from harness.measure.env import code_sha

    exp = _cut(step, plan_dir)
    rows = res.read_rows(res.results_path(results, exp.name, slug))
    latest = _latest_finished(rows)
    history, elsewhere = res.wall_history(results, exp.name, slug)
    by_group: dict[tuple, list] = {}
    for p in exp.points():
        by_group.setdefault((p.model, p.seq_len), []).append(p)
    code, now = code_sha(), time.time()
    todo = []
    for pts in by_group.values():
        # what a reader compares side by side (stock, the peer, enable()) must come from one run;
        # the step's other variants (ours' settings, ablations) need only a finished row each
        side = [p for p in pts if roles.parts(vars(p)) & set(roles.SIDE_BY_SIDE)] or pts
        todo.append(group_todo(side, latest, code, now, step.estimate_s, history, elsewhere))
        todo.append(([p for p in pts if p not in side and p.point_id not in latest], False))
    return exp, [(pts, over) for pts, over in todo if pts]


def _context_left(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> tuple[list, int]:
    """What a context step's command would still probe on ``slug``, from its rows alone
    (``context.left``: the searches not over, the meeting probes owed), and its searches in all, as
    its arguments cut and bound them."""
    import dataclasses

    ap = argparse.ArgumentParser(add_help=False)
    for flag in ("--models", "--variants"):
        ap.add_argument(flag, nargs="+")
    ap.add_argument("--start", type=int)
    ap.add_argument("--max-len", type=int, default=context_cli.MAX_LEN)
    ap.add_argument("--resolution", type=int, default=context_cli.RESOLUTION)
    ap.add_argument("--keep-older-rows", action="store_true")
    known, _ = ap.parse_known_args(step.args)
    exp = experiment.subset(experiment.load(plan_dir / step.context), models=known.models, variants=known.variants)
    if known.start:
        exp = dataclasses.replace(exp, seq_lens=[known.start])
    rows = res.read_rows(res.results_path(results, exp.name, slug))
    todo = context_cli.left(exp, rows, None if known.keep_older_rows else code_id(), max_len=known.max_len,
                        resolution=known.resolution)
    return todo, len(exp.models) * len(exp.variants)


def points_left(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> tuple[int, int]:
    """(points without a finished row on ``slug``, points in all) of a sweep step (of a together
    step: the points its groups still run); a bench step is one point, done once the rows its
    command wrote cover every model and length it names (``_covered``); a context step counts its
    searches, one left while it is not over or owes its meeting probe (``_context_left``)."""
    if step.context:
        todo, n = _context_left(step, plan_dir, results, slug)
        return len({(m, v) for m, v, _ in todo}), n
    if step.sweep and step.together:
        exp, todo = _groups(step, plan_dir, results, slug)
        return sum(len(pts) for pts, _ in todo), len(exp.points())
    if step.sweep:
        exp = _cut(step, plan_dir)
        done = res.finished_point_ids(res.results_path(results, exp.name, slug), code_id())
        ids = [p.point_id for p in exp.points()]
        return sum(i not in done for i in ids), len(ids)
    rows = res.read_rows(res.results_path(results, str(step.experiment), slug))
    return int(not _covered(step, [r for r in rows if _ran(step, str(r.get("command") or ""))])), 1


def seconds_left(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> float:
    """What the step's work left on ``slug`` should take: each point as ``res.point_estimate_s``
    expects it (its own longest earlier wall time there, else a margin over its time on another GPU
    type, else the step's ``estimate_s``); a pending bench its estimate_s; a context step its
    estimate_s a probe left, at the least (a search not over has one probe or more to go)."""
    if step.context:
        return step.estimate_s * len(_context_left(step, plan_dir, results, slug)[0])
    if not step.sweep:
        return step.estimate_s if pending(step, plan_dir, results, slug) else 0.0
    here, elsewhere = res.wall_history(results, _cut(step, plan_dir).name, slug)
    return sum(res.point_estimate_s(here, p.point_id, step.estimate_s, elsewhere)
               for _, pts in work(step, plan_dir, results, slug) for p in pts)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


# a bench's options that name what it measures, and the row field that records each value
_NAMES = {"--model": "model", "--models": "model", "--seq-len": "length", "--lengths": "length", "--tokens": "length"}


def _covered(step: plan_file.Step, rows: list[dict]) -> bool:
    """Whether the rows a bench step's command wrote hold every model and length its arguments
    name: a bench writes each model's or length's rows as it finishes them, so one stopped halfway
    (out of time, killed) has rows for part of what it was asked, and is not done."""
    named: dict[str, set] = {}
    field = None
    for word in step.args:
        if word.startswith("--"):
            field = _NAMES.get(word)
        elif field:
            named.setdefault(field, set()).add(int(word) if field == "length" else word)
    rows = [r for r in rows if r.get("status") != "error"]  # a crashed part is not done: the next call runs it again
    have = {"model": {r.get("model") for r in rows},
            "length": {r.get(k) for r in rows for k in ("seq_len", "tokens")}}
    return bool(rows) and all(values <= have[f] for f, values in named.items())


def pending(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> bool:
    return points_left(step, plan_dir, results, slug)[0] > 0


def status(plan_path: Path | str, slug: str, gib: float | None = None, results: Path | str = "results") -> int:
    """What is left of the plan on the GPU type ``slug`` (as results/ names it, e.g. nvidia-h200),
    read from the rows alone: no GPU needed. ``gib`` (else the rows' recorded memory) decides the
    steps that need a larger GPU."""
    plan = plan_file.load(plan_path)
    plan_dir, results = plan.path.parent, Path(results)
    if not any(res.results_path(results, exp, slug).exists() for exp in plan.experiments()):
        others = sorted({f.stem for exp in plan.experiments() for f in (results / exp).glob("*.jsonl")})
        if len(named := [o for o in others if slug.lower() in o]) == 1:  # "h100" for nvidia-h100-80gb-hbm3
            print(f"{slug}: the GPU type with rows whose name holds it is {named[0]}", file=sys.stderr)
            slug = named[0]
        elif others:  # a misspelt GPU type would otherwise read as "nothing has run"
            print(f"no rows for {slug} under {results}/; the GPU types with rows: {', '.join(others)}",
                  file=sys.stderr)
    if gib is None:
        mems = [float(m) for exp in plan.experiments() for r in res.read_rows(res.results_path(results, exp, slug))
                if isinstance(m := (r.get("env") or {}).get("memory_total_gib"), (int, float))]
        gib = max(mems) if mems else None
    lines, totals = [], {False: [0, 0, 0.0], True: [0, 0, 0.0]}  # per appendix: [left, all, seconds]
    searches = [0, 0, 0.0]  # the context steps': [left, all, seconds at the least]
    for step in plan.steps:
        if step.min_gpu_gib and gib is not None and gib < step.min_gpu_gib:
            lines.append((step.label, f"skipped: needs {step.min_gpu_gib:g} GiB, {slug} has {gib:.0f}"))
            continue
        n_left, n = points_left(step, plan_dir, results, slug)
        secs = seconds_left(step, plan_dir, results, slug) if n_left else 0.0
        tally = searches if step.context else totals[step.appendix]
        tally[0] += n_left
        tally[1] += n
        tally[2] += secs
        lines.append((step.label, "done" if not n_left else
                      f"{n_left} of {n} searches left, at least ~{_minutes(secs)}" if step.context else
                      (f"{n_left} of {n} points left" if step.sweep else "bench not run") + f", ~{_minutes(secs)}"))
    width = max(len(name) for name, _ in lines) if lines else 0
    print(f"{plan.path.name} on {slug}" + (f" ({gib:.0f} GiB)" if gib is not None else " (memory unknown: "
                                             "every step counted; --gpu-gib decides the large-GPU steps)"))
    for name, text in lines:
        print(f"  {name:<{width}}  {text}")
    for appendix, what in ((False, "the report's figures"), (True, "the appendix's tables")):
        n_left, n, secs = totals[appendix]
        if n:
            print(f"  {what}: " + (f"{n_left} of {n} points left, ~{_minutes(secs)} of GPU time" if n_left else "done"))
    if searches[1]:
        print("  the long-context searches: " + (f"{searches[0]} of {searches[1]} left, at least ~{_minutes(searches[2])} "
                                                 "of GPU time (one probe each, at its step's estimate_s; a search "
                                                 "takes several)" if searches[0] else "done"))
    if totals[False][0] + totals[True][0]:
        print("  (~: each point's own longest wall time on this GPU type, else half as long again as on another "
              "(at most its step's estimate_s), else its step's estimate_s, the longest any of its points takes)")
    return 0 if not totals[False][0] + totals[True][0] + searches[0] else 3


def _ran(step: plan_file.Step, command: str) -> bool:
    """Whether a bench row's recorded command is this step's: its module, with the step's
    arguments in order (other options, such as --results, around them)."""
    words, args = shlex.split(command), list(step.args)
    if f"harness.bench.{step.bench}" not in words:
        return False
    return not args or any(words[i:i + len(args)] == args for i in range(len(words)))


def work(step: plan_file.Step, plan_dir: Path, results: Path, slug: str) -> list[tuple[list[str], list]]:
    """The step's command lines, each with the points it will run (none for a bench): one, or for
    a together step one per group with work, cut to that model and length (and to its missing
    variants, or all of them with --overwrite)."""
    if not step.sweep:
        return [(step.argv(plan_dir), [])]
    if not step.together:
        exp = _cut(step, plan_dir)
        done = res.finished_point_ids(res.results_path(results, exp.name, slug), code_id())  # as the sweep resumes
        return [(step.argv(plan_dir), [p for p in exp.points() if p.point_id not in done])]
    _, todo = _groups(step, plan_dir, results, slug)
    _, rest = _parse_cut(step)
    return [(["-m", "harness", "sweep", str(plan_dir / step.sweep), "--no-report", *rest,
              "--models", pts[0].model, "--seq-lens", str(pts[0].seq_len),
              "--variants", *dict.fromkeys(p.variant for p in pts), *(["--overwrite"] if over else [])], pts)
            for pts, over in todo]


# what a sweep process spends before its clock starts (interpreter, torch and transformers imports)
_START_S = 10.0


def _needs(step: plan_file.Step, pts: list, here: dict, elsewhere: dict, budget: float) -> float:
    """The seconds a command must have left to start. A point's estimate is its own longest earlier
    wall time on this GPU type, else a margin over its time on another, else the step's estimate_s
    (the longest any of its points or its bench takes). A together step's side-by-side group (stock,
    the peer, enable()) needs all of its points to fit, since its rows count only from one run,
    unless they would not fit in a whole call; any other command needs its shortest point to fit,
    and the sweep then starts each point only if that one fits."""
    est = [res.point_estimate_s(here, p.point_id, step.estimate_s, elsewhere) for p in pts] or [step.estimate_s]
    side = step.together and all(roles.parts(vars(p)) & set(roles.SIDE_BY_SIDE) for p in pts)
    return sum(est) if side and sum(est) <= budget else min(est)


def _chosen(plan: plan_file.Plan, names) -> list[plan_file.Step]:
    """The plan's steps named in ``names`` (all of them when none), in the plan's order."""
    if not names:
        return list(plan.steps)
    known = {s.name for s in plan.steps}
    if unknown := [n for n in names if n not in known]:
        raise experiment.ExperimentError(plan.path, "blog.steps", f"no step named {', '.join(map(repr, unknown))} "
                                         f"(the plan's steps: {', '.join(repr(s.name) for s in plan.steps)})")
    return [s for s in plan.steps if s.name in set(names)]


def run(plan_path: Path | str, *, minutes: float = 9.0, results: Path | str = "results", dry_run: bool = False,
        steps=None) -> int:
    """Run the plan's pending steps (only those named in ``steps``, if given) within ``minutes``."""
    plan = plan_file.load(plan_path)
    plan_dir, results = plan.path.parent, Path(results)
    chosen = _chosen(plan, steps)
    name, gib = _gpu()
    if name == "cpu" and not dry_run:
        print("error: the plan's sweeps and benches need a CUDA GPU (--dry-run lists them)", file=sys.stderr)
        return 2
    slug = res.gpu_slug(name)
    start, budget = time.monotonic(), minutes * 60
    left = []
    for step in chosen:
        if step.min_gpu_gib and gib < step.min_gpu_gib:
            print(f"skip {step.name}: needs a GPU of {step.min_gpu_gib:g} GiB, this one has {gib:.0f}", file=sys.stderr)
            continue
        if not pending(step, plan_dir, results, slug):
            print(f"done {step.name}", file=sys.stderr)
            continue
        here, elsewhere = res.wall_history(results, _cut(step, plan_dir).name, slug) if step.sweep else ({}, {})
        for argv, pts in work(step, plan_dir, results, slug):
            start_s = _START_S if step.sweep or step.context else 0.0
            remaining = budget - (time.monotonic() - start) - start_s
            needs = _needs(step, pts, here, elsewhere, budget)
            if needs > budget - start_s:  # no call of this length would ever start it
                print(f"skip {step.name}: it needs {needs:.0f} s to start, more than --minutes {minutes:g} gives; "
                      f"run with --minutes {(needs + start_s) / 60 + 1:.0f} or more", file=sys.stderr)
                continue
            if remaining < needs:
                continue
            argv = [sys.executable, *argv, "--results", str(results)]
            if step.sweep:
                argv += ["--deadline", f"{remaining:.0f}", "--point-estimate", f"{step.estimate_s:g}"]
            if step.context:  # no probe starts that could end past the budget
                argv += ["--stop-after", f"{remaining - step.estimate_s:.0f}"]
            print(f"run {step.name}: {' '.join(argv[1:])}", file=sys.stderr)
            if dry_run:
                continue
            rc = subprocess.run(argv).returncode
            if rc == context_cli.ENDED_ON_A_FAILED_PROBE and step.context:  # a refusal or failure: its row says why
                rc = 0
            if rc != 0:
                print(f"error: {step.name} exited {rc}; its rows so far are kept, a rerun resumes", file=sys.stderr)
                return 1
        if dry_run or pending(step, plan_dir, results, slug):
            left.append(step.label)
    if dry_run:
        print(f"dry run: {len(left)} steps would run", file=sys.stderr)
        return 0
    if left:
        print(f"not finished within {minutes:g} min: {', '.join(left)}; run the same command again", file=sys.stderr)
        return 3
    what = "every step" if len(chosen) == len(plan.steps) else ", ".join(s.label for s in chosen)
    print(f"done: {what} of {plan.path.name} has its rows on {name}", file=sys.stderr)
    return 0
