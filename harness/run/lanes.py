"""One host's GPUs, one sweep: ``python -m harness sweep EXP --devices 0 1 2 3``.

Each lane is one device (``0``), or several for points that take several (``0,1``). A group is one
model at one length, with every variant the sweep runs there. A group runs in one lane, its variants
one after another as a plain sweep runs them, so the roles compared at a point share one GPU and
one run. The groups go to the lanes longest first, each to the lane that would finish soonest,
by the wall times earlier rows recorded on this GPU type (a group never run counts one second
per variant).

Each group is a child ``python -m harness sweep`` of this experiment file, restricted to the
group's model, length and variants, with ``CUDA_VISIBLE_DEVICES`` set to its lane. It resumes,
records and stops like any sweep. Every child writes to the one results file, under its lock. Its
rows name the lane (``lane``). The host-to-device bandwidth is measured once, before the lanes
start, on the first lane, while nothing else runs.

A stopped sweep (Ctrl-C, or SIGTERM, which the CLI turns into an exit) stops every child. Each child
then keeps a ``stopped`` row for its point in flight, and the same command resumes. The same
happens when ``--stop-after`` passes: it holds for the whole sweep, and each child gets what is
left of it. Per group, the child's output goes to ``results/<experiment>/logs/lanes/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import results as res

LANE_ENV = "PACKBENCH_LANE"  # set in each child: its lane; the child's sweep skips the bandwidth


@dataclass
class LanesSummary:
    results_path: Path
    groups: int = 0
    failed: list[str] = field(default_factory=list)  # "model length: exit code"
    left: int = 0  # groups not started (--stop-after)


def groups(exp) -> list[tuple[str, int]]:
    """The (model, length) pairs of the experiment's points, in their order."""
    return list(dict.fromkeys((p.model, p.seq_len) for p in exp.points()))


def check(exp, lanes: list[str]) -> None:
    """ValueError where a lane holds fewer GPUs than a point takes, or a GPU is in two lanes."""
    need = max((p.gpus for p in exp.points()), default=1)
    short = [lane for lane in lanes if len(lane.split(",")) < need]
    if short:
        raise ValueError(f"--devices: points of {exp.name} take {need} GPUs, and lane(s) {short} hold fewer; "
                         f"name each lane's GPUs with commas, e.g. --devices 0,1 2,3")
    named = [d for lane in lanes for d in lane.split(",")]
    if len(set(named)) != len(named) or "" in named:
        raise ValueError(f"--devices {' '.join(lanes)}: each GPU in one lane, named once")


def plan(exp, lanes: list[str], walls: dict[str, float]) -> list[list[tuple[str, int]]]:
    """Per lane, its groups: longest first, each to the lane whose load is least (ties to the
    first lane). A group's length is the sum of its points' recorded walls, 1 s for a point with none."""
    points = exp.points()
    check(exp, lanes)
    cost = {g: 0.0 for g in groups(exp)}
    for p in points:
        cost[(p.model, p.seq_len)] += walls.get(p.point_id, 1.0)
    out: list[list[tuple[str, int]]] = [[] for _ in lanes]
    load = [0.0] * len(lanes)
    for g in sorted(cost, key=lambda g: -cost[g]):  # stable: equal costs keep the file's order
        i = min(range(len(lanes)), key=lambda j: (load[j], j))
        out[i].append(g)
        load[i] += cost[g]
    return out


def child_argv(path: Path, group: tuple[str, int], variants: list[str], args, remaining_s: float | None) -> list[str]:
    argv = [sys.executable, "-m", "harness", "sweep", str(path), "--models", group[0], "--seq-lens",
            str(group[1]), "--variants", *variants, "--results", str(args.results), "--no-report", "--quiet"]
    for flag, on in (("--overwrite", args.overwrite), ("--keep-older-rows", args.keep_older_rows)):
        if on:
            argv.append(flag)
    for flag, value in (("--launcher", args.launcher), ("--timeout", args.timeout),
                        ("--stop-after", remaining_s)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def run(exp, path: Path, args, lanes: list[str], stream=sys.stderr) -> LanesSummary:
    """Run ``exp`` (the file at ``path``, already restricted by ``args``) over ``lanes``."""
    from harness.run import sweep

    check(exp, lanes)  # before anything runs
    started = time.monotonic()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = lanes[0]  # named and measured on the first lane, no context here
    try:
        device_name = sweep.detect_device_name(exp.device)
        slug = res.gpu_slug(device_name)
        results = res.results_path(args.results, exp.name, slug)
        res.check_writable(results.parent)
        sweep.keep_experiment_file(exp, args.results)
        sweep.ensure_bandwidth(exp, results, device_name, slug, overwrite=args.overwrite)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    layout = plan(exp, lanes, res.point_wall_s(res.read_rows(results)))
    summary = LanesSummary(results_path=results, groups=sum(map(len, layout)))
    log_dir = Path(args.results) / exp.name / "logs" / "lanes"
    log_dir.mkdir(parents=True, exist_ok=True)
    variants = list(exp.variants)
    running: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()
    stopping = threading.Event()

    def say(text: str) -> None:
        with lock:
            stream.write(f"[{time.monotonic() - started:7.0f} s] {text}\n")
            stream.flush()

    def lane_worker(lane: str, todo: list[tuple[str, int]]) -> None:
        for n, group in enumerate(todo):
            remaining = None if args.stop_after is None else args.stop_after - (time.monotonic() - started)
            if stopping.is_set() or (remaining is not None and remaining <= 0):
                with lock:
                    summary.left += len(todo) - n
                return
            name = f"{group[0]} {group[1]}"
            log = log_dir / f"{lane.replace(',', '+')}-{group[0]}-{group[1]}.log"
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": lane, LANE_ENV: lane}
            say(f"lane {lane}: {name} ({len(variants)} variants) started, log {log}")
            with open(log, "w") as out:
                proc = subprocess.Popen(child_argv(path, group, variants, args, remaining), stdout=out,
                                        stderr=subprocess.STDOUT, env=env)
                with lock:
                    running[lane] = proc
                code = proc.wait()
                with lock:
                    running.pop(lane, None)
            if code != 0 and not stopping.is_set():
                with lock:
                    summary.failed.append(f"{name}: exit {code}")
            say(f"lane {lane}: {name} finished, exit {code}")

    threads = [threading.Thread(target=lane_worker, args=(lane, todo), daemon=True)
               for lane, todo in zip(lanes, layout) if todo]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.5)
    except (KeyboardInterrupt, SystemExit):  # stop every child: each keeps its point's stopped row
        stopping.set()
        with lock:
            procs = list(running.values())
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return summary


def cmd(exp, path: Path, args) -> int:
    """``sweep --devices``: 0 when every group's sweep exited cleanly, 1 when one did not, 2 when
    the request cannot run (nothing ran)."""
    if args.cluster or args.deadline is not None:
        print("error: --devices runs the lanes on this host: not with --cluster or --deadline", file=sys.stderr)
        return 2
    try:
        summary = run(exp, path, args, args.devices)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{summary.groups} groups over {len(args.devices)} lanes; failed: {', '.join(summary.failed) or 'none'}; "
          f"{summary.left} not started (--stop-after: the same command resumes); rows in {summary.results_path}",
          file=sys.stderr)
    return 1 if summary.failed else 0
