"""One host's GPUs, one sweep: ``python -m harness sweep EXP --devices 0 1 2 3``.

Each lane is one GPU (``0``), or several for points that take several (``0,1``), named as
``CUDA_VISIBLE_DEVICES`` names them. A group is one model at one length, with every variant the
sweep runs there. A group runs in one lane, its variants one after another as a plain sweep runs
them, so the roles compared at a point share one GPU and one run. The groups with points left go
to the lanes longest first, each to the lane that would finish soonest, by the wall times earlier
rows recorded on this GPU type (a point never run counts one second).

Each group is a child ``python -m harness sweep`` of the experiment file as this sweep read it
(the copy kept under results/), restricted to the group's model, length and variants, with
``CUDA_VISIBLE_DEVICES`` set to its lane. It resumes and records like any sweep. Every child
writes to the one results file, under its lock. Its rows name the lane (``lane``) and the command
that started the lanes. The host-to-device bandwidth is measured once, before the lanes start, on
the first lane, while nothing else runs.

A stopped sweep (Ctrl-C, or SIGTERM, which the CLI turns into an exit) stops every child, and a
child dies with this process however it dies. Each child then keeps a ``stopped`` row for its
point in flight, and the same command resumes. ``--stop-after`` holds for the whole sweep: each
child gets what is left of it and starts no point past it. Per group, the child's output is added
to ``results/<experiment>/logs/lanes/``.

The lanes share the host's CPUs: a CPU experiment is refused (its points would time each other),
and so is one that pins each point to a core (every lane would pin the same one).
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
from harness.run import gpu_lock, sweep
from harness.run.sweep import LANE_ENV, PARENT_ENV

COMMAND_ENV = "PACKBENCH_COMMAND"  # the command that started the lanes, recorded in each child's rows
CPU_ENV = "PACKBENCH_LANES_ON_CPU"  # tests: lanes of a CPU experiment, the lane names only names


@dataclass
class LanesSummary:
    results_path: Path
    groups: int = 0
    failed: list[str] = field(default_factory=list)  # "model length: why"
    left: int = 0  # groups not started (--stop-after)


def groups(points) -> list[tuple[str, int]]:
    """The (model, length) pairs of the points, in their order."""
    return list(dict.fromkeys((p.model, p.seq_len) for p in points))


def _gpus() -> tuple[int, set[str]] | None:
    """NVML's GPU count and UUIDs on this host, None where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            uuids = set()
            for i in range(n):
                u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                uuids.add(u.decode() if isinstance(u, bytes) else u)
            return n, uuids
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver
        return None


def check(exp, lanes: list[str]) -> None:
    """ValueError, before anything runs, where the lanes cannot run the file: a GPU named twice or
    not on this host, a lane with fewer GPUs than a point takes, a CPU or core-pinned experiment."""
    points = exp.points()
    named = [d for lane in lanes for d in lane.split(",")]
    if len(set(named)) != len(named) or "" in named:
        raise ValueError(f"--devices {' '.join(lanes)}: each GPU in one lane, named once")
    need = max((p.gpus for p in points), default=1)
    short = [lane for lane in lanes if len(lane.split(",")) < need]
    if short:
        raise ValueError(f"--devices: points of {exp.name} take {need} GPUs, and lane(s) {short} hold fewer; "
                         f"name each lane's GPUs with commas, e.g. --devices 0,1 2,3")
    if any(p.pin_cpu for p in points):
        raise ValueError(f"--devices: {exp.name} pins each point to one core (pin_cpu), the same core in every lane")
    if os.environ.get(CPU_ENV):
        return
    gpus = _gpus()
    if exp.device == "cpu" or not gpus or not gpus[0]:
        raise ValueError(f"--devices names GPUs, and {exp.name} runs on the CPU here: its points would share "
                         "the cores and time each other")
    count, uuids = gpus
    unknown = [d for d in named if not (d.isdigit() and int(d) < count)
               and d not in uuids and f"GPU-{d}" not in uuids]
    if unknown:
        raise ValueError(f"--devices: {unknown} name no GPU of this host's {count} (an index or a UUID); "
                         "a lane list ends at the next option, so put the experiment file first")


def plan(points, lanes: list[str], walls: dict[str, float]) -> list[list[tuple[str, int]]]:
    """Per lane, its groups: longest first, each to the lane whose load is least (ties to the
    first lane). A group's length is the sum of its points' recorded walls, 1 s for a point with none."""
    cost = {g: 0.0 for g in groups(points)}
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


def _prepare(exp, args, lane0: str):
    """On the first lane, with no CUDA context here: the GPU's name, the results file, the kept
    experiment file and the bandwidth rows."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = lane0
    try:
        device_name = sweep.detect_device_name(exp.device)
        slug = res.gpu_slug(device_name)
        results = res.results_path(args.results, exp.name, slug)
        res.check_writable(results.parent)
        kept = sweep.keep_experiment_file(exp, args.results)
        gpus = [] if device_name == "cpu" else gpu_lock.visible_gpus(len(lane0.split(",")))
        try:
            with gpu_lock.hold(gpus, f"the bandwidth rows of {exp.name}'s lanes", timeout_s=args.stop_after):
                sweep.ensure_bandwidth(exp, results, device_name, slug, overwrite=args.overwrite)
        except gpu_lock.Busy as e:  # the lanes' children wait for their own GPUs, each within its time
            sys.stderr.write(f"{e}: the bandwidth rows are left for a later run\n")
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return results, kept


def run(exp, path: Path, args, lanes: list[str], stream=sys.stderr) -> LanesSummary:
    """Run ``exp`` (the file at ``path``, already restricted by ``args``) over ``lanes``."""
    check(exp, lanes)  # before anything runs
    started = time.monotonic()
    results, kept = _prepare(exp, args, lanes[0])
    points = exp.points()
    if not args.overwrite:
        done, older = sweep.finished(results, points, keep_older=args.keep_older_rows)
        if older:
            stream.write(older + "\n")
        points = [p for p in points if p.point_id not in done]
    layout = plan(points, lanes, res.point_wall_s(res.read_rows(results)))
    summary = LanesSummary(results_path=results, groups=sum(map(len, layout)))
    log_dir = Path(args.results) / exp.name / "logs" / "lanes"
    log_dir.mkdir(parents=True, exist_ok=True)
    variants = list(exp.variants)
    env_base = {**os.environ, COMMAND_ENV: args.command, PARENT_ENV: str(os.getpid())}
    running: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()
    stopping = threading.Event()

    def say(text: str) -> None:
        with lock:
            stream.write(f"[{time.monotonic() - started:7.0f} s] {text}\n")
            stream.flush()

    def one_group(lane: str, group: tuple[str, int], remaining: float | None) -> int | None:
        name = f"{group[0]} {group[1]}"
        log = log_dir / f"{lane.replace(',', '+')}-{group[0]}-{group[1]}.log"
        with open(log, "a") as out:
            with lock:  # started and recorded together: a stop in between would miss it
                if stopping.is_set():
                    return None
                proc = subprocess.Popen(child_argv(kept or path, group, variants, args, remaining), stdout=out,
                                        stderr=subprocess.STDOUT, env={**env_base, "CUDA_VISIBLE_DEVICES": lane,
                                                                       LANE_ENV: lane})
                running[lane] = proc
            say(f"lane {lane}: {name} ({len(variants)} variants) started, log {log}")
            code = proc.wait()
            with lock:
                running.pop(lane, None)
        say(f"lane {lane}: {name} finished, exit {code}")
        return code

    def lane_worker(lane: str, todo: list[tuple[str, int]]) -> None:
        for n, group in enumerate(todo):
            remaining = None if args.stop_after is None else args.stop_after - (time.monotonic() - started)
            if stopping.is_set() or (remaining is not None and remaining <= 0):
                with lock:
                    summary.left += len(todo) - n
                return
            try:
                code = one_group(lane, group, remaining)
            except Exception as e:  # noqa: BLE001 - a log or process that cannot start: the group failed
                code = f"{type(e).__name__}: {e}"
            if code not in (0, None) and not stopping.is_set():
                with lock:
                    summary.failed.append(f"{group[0]} {group[1]}: " + (f"exit {code}" if isinstance(code, int) else code))

    threads = [threading.Thread(target=lane_worker, args=(lane, todo), daemon=True)
               for lane, todo in zip(lanes, layout) if todo]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.5)
    except (KeyboardInterrupt, SystemExit):  # stop every child: each keeps its point's stopped row
        with lock:
            stopping.set()
            procs = list(running.values())
        for proc in procs:
            proc.terminate()
        end = time.monotonic() + 60  # one deadline for them all
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for t in threads:
            t.join(timeout=5)
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
          f"{summary.left} groups not started (--stop-after: the same command resumes); rows in "
          f"{summary.results_path}", file=sys.stderr)
    return 1 if summary.failed else 0
