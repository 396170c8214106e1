"""Experiment → points → one fresh process per point → rows appended to results/.

A rerun resumes: points already finished (ok or oom) in the results file by this code
(``env.code_id``: the optim/ and harness/ sources and the versions of torch, transformers, peft and
the peers) are skipped unless ``overwrite`` is set. A point finished by other code is measured
again, and the sweep says so in one line, unless ``keep_older`` counts those rows as finished.
Rows are written one at a time, atomically, as each point ends, so a sweep killed midway loses only
the point in flight.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import results as res
from harness import row as rowmod
from harness.errors import InputError
from harness.measure import env as envmod
from harness.measure.env import REPO_ROOT
from harness.run import gpu_lock
from harness.run.experiment import Experiment
from harness.run.launchers import for_point


@dataclass
class SweepSummary:
    results_path: Path
    ran: int = 0
    skipped: int = 0
    left: int = 0  # points not started: past --stop-after, or their estimate would end past --deadline
    statuses: dict[str, int] = field(default_factory=dict)


def detect_device_name(requested: str) -> str:
    """The device a sweep will run on, named without creating a CUDA context in this process
    (that would hold GPU memory for the whole sweep)."""
    if requested == "cpu":
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() > 0:
                name = pynvml.nvmlDeviceGetName(envmod.nvml_handle(pynvml, 0))
                return name.decode() if isinstance(name, bytes) else name
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVIDIA driver: a CPU machine
        pass
    if requested == "cuda":
        raise InputError("the experiment asks for device 'cuda' but no NVIDIA GPU is visible here "
                         "(device = \"auto\" runs on what the machine has)")
    return "cpu"


class Progress:
    """One status line: point i/n, its label, the step within it, the last step time and the ETA.

    The ETA adds up what each point left is expected to take: its wall time recorded by an
    earlier run on this GPU type (``expected_s``, in the order the points run), else the mean of
    the points this run has finished; the point running counts what it has left of its own."""

    def __init__(self, total: int, stream=sys.stderr, expected_s: list[float | None] | None = None):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.done = 0
        self.expected = list(expected_s) if expected_s is not None else [None] * total
        self.took: list[float] = []
        self.label = ""
        self.index, self.running_since = 0, None

    def start(self, index: int, label: str) -> None:
        self.index, self.label, self.running_since = index, label, time.monotonic()
        self._line(f"[{index}/{self.total}] {label}  starting", final=not self.tty)

    def step(self, info: dict) -> None:
        if not self.tty:
            return
        if "step" not in info:  # a phase before the first step: building the model, compiling
            self._line(f"[{self.index}/{self.total}] {self.label}  {info.get('phase', '')}  ETA {self._eta()}")
            return
        last = info.get("last_step_ms")
        last_s = f"{last:8.1f} ms" if last is not None else "      … ms"
        self._line(f"[{self.index}/{self.total}] {self.label}  step {info['step']}/{info['of']}  last {last_s}  ETA {self._eta()}")

    def finish(self, status: str, row: dict) -> None:
        self.done += 1
        if self.running_since is not None:
            self.took.append(time.monotonic() - self.running_since)
            self.running_since = None
        p50 = (row.get("step_ms") or {}).get("p50")
        extra = f"p50 {p50:.1f} ms" if p50 is not None else row.get("message", "")[:80]
        self._line(f"[{self.index}/{self.total}] {self.label}  {status}  {extra}  ETA {self._eta()}", final=True)

    def eta_s(self) -> float | None:
        """Seconds left by the recorded wall times and this run's own; None with neither."""
        known = [e for e in self.expected if e is not None]
        typical = statistics.mean(self.took) if self.took else (statistics.mean(known) if known else None)
        left = 0.0
        if self.running_since is not None:  # the point under way: what it has left of its own
            own = self.expected[self.index - 1] if 0 < self.index <= self.total else None
            own = own if own is not None else typical
            if own is None:
                return None
            left += max(0.0, own - (time.monotonic() - self.running_since))
        for e in self.expected[self.index:]:
            e = e if e is not None else typical
            if e is None:
                return None
            left += e
        return left

    def _eta(self) -> str:
        left = self.eta_s()
        if left is None:
            return "?"
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def _line(self, text: str, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# A lane of ``sweep --devices`` (harness/run/lanes.py) runs as a child sweep with these set.
LANE_ENV = "PACKBENCH_LANE"  # its lane; the lanes' process measured the bandwidth
PARENT_ENV = "PACKBENCH_LANES_PID"  # the lanes' process, which the child dies with


def term_with_parent() -> None:
    """Called by a lane's child sweep (Linux): SIGTERM it when the lanes' process dies, however it
    dies, so the child unwinds and keeps its point's stopped row; if that process is already gone,
    now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def run_bandwidth_rows(experiment: str, timeout_s: float = 600) -> list[dict]:
    """The H2D benchmark in its own process, like every other measurement."""
    with tempfile.TemporaryDirectory(prefix="packbench-bw-") as tmp:
        out = os.path.join(tmp, "bw.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(
            [sys.executable, "-m", "harness", "bandwidth", "--json", out],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            return [{"kind": "bandwidth", "status": "error", "experiment": experiment,
                     "message": (proc.stderr or proc.stdout)[-500:]}]
        with open(out) as f:
            payload = json.load(f)
    rows = payload["rows"]
    for r in rows:
        r["experiment"] = experiment
        r["env"] = payload["env"]
    return rows


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up included), None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def scaling_efficiency(row: dict, rows: list[dict]) -> float | None:
    """A point on N > 1 GPUs: its tokens/s per GPU over the same point's tokens/s on one GPU
    (the latest ok row of ``rows`` with the same identity but ``gpus`` = 1), else None."""
    if row.get("status") != "ok" or (row.get("gpus") or 1) <= 1 or not row.get("tokens_per_s_per_gpu"):
        return None
    key = rowmod.match_key({**row, "gpus": 1})
    ones = [r for r in rows if r.get("kind", "step") == "step" and r.get("status") == "ok"
            and r.get("gpus") == 1 and r.get("tokens_per_s") and rowmod.match_key(r) == key]
    return row["tokens_per_s_per_gpu"] / ones[-1]["tokens_per_s"] if ones else None


def append_point_row(path: Path, row: dict) -> None:
    """Append a point's row, with its scaling efficiency when it ran on several GPUs (only then is
    the results file read back). It replaces the point's rows of the same code and its unfinished
    ones; a finished row of other code (``env.code_id``) stays, as that code's result, and so does
    an ok row of the same code where this row failed (a rerun that ran out of memory beside another
    process loses no measurement: the reports read the ok row)."""
    if row.get("status") == "ok" and (row.get("gpus") or 1) > 1:
        efficiency = scaling_efficiency(row, res.read_rows(path))
        if efficiency is not None:
            row["scaling_efficiency"] = efficiency
    pid, code = row.get("point_id"), (row.get("env") or {}).get("code_id")

    failed = row.get("status") != "ok"

    def superseded(r: dict) -> bool:
        return bool(pid) and r.get("point_id") == pid and (
            not res.is_finished(r)
            or ((r.get("env") or {}).get("code_id") == code and not (failed and r.get("status") == "ok")))

    res.replace_rows(path, superseded, [row])


def stopped_row(point, ran_s: float, slug: str, device_name: str) -> dict:
    """What a sweep stopped halfway through a point keeps of it: how long it had run, as a row of
    kind "stopped" that no table, gate or resume reads as the point's result (it runs again, and
    its finished row replaces this one), but that ``res.point_wall_s`` reads, so the next run
    expects the point to take at least that long."""
    return {"kind": "stopped", "point_id": point.point_id, "experiment": point.experiment, "model": point.model,
            "seq_len": point.seq_len, "variant": point.variant, "wall_s": round(ran_s, 3), "gpu_slug": slug,
            "device_name": device_name, "recorded_at": res.now(),
            "message": f"the sweep stopped {ran_s:.0f} s into this point; a rerun runs it again"}


def keep_experiment_file(exp: Experiment, results_root: str | Path) -> Path | None:
    """The experiment file as it was read, under results/<experiment>/experiments/<sha>.toml, so
    rows (which record ``experiment_sha256``) and reports need nothing outside results/."""
    if not exp.text:
        return None
    path = Path(results_root) / exp.name / "experiments" / f"{exp.sha256[:16]}.toml"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(exp.text)
        tmp.replace(path)
    return path


def ensure_bandwidth(exp: Experiment, path: Path, device_name: str, slug: str, *, overwrite: bool,
                     existing: list[dict] | None = None) -> None:
    """The experiment's host-to-device bandwidth rows, measured where it asks for them on a GPU and
    the results file has none that passed (or ``overwrite``)."""
    if not exp.bandwidth or device_name == "cpu":
        return
    existing = res.read_rows(path) if existing is None else existing
    if overwrite or not any(r.get("kind") == "bandwidth" and r.get("status") == "ok" for r in existing):
        rows = run_bandwidth_rows(exp.name)
        for row in rows:
            row.update(gpu_slug=slug, device_name=device_name, recorded_at=res.now())
        res.replace_rows(path, lambda r: r.get("kind") == "bandwidth", rows)


def finished(path: Path, points, *, keep_older: bool) -> tuple[set[str], str]:
    """(the point ids a resume skips, a line saying which finished points other code measured,
    "" if none). Other code's rows count as finished only with ``keep_older``."""
    from harness.measure.env import code_id

    code = code_id()
    ours, anyone = res.finished_point_ids(path, code), res.finished_point_ids(path)
    older = [p for p in points if p.point_id in anyone - ours]
    if not older:
        return ours, ""
    if keep_older:
        return anyone, (f"keeping {len(older)} finished point(s) measured by other code than this "
                        f"(code_id {code}) as done (--keep-older-rows)")
    return ours, (f"measuring {len(older)} finished point(s) again: their rows were measured by other code "
                  f"than this (code_id {code}: the optim/ and harness/ sources, torch, transformers, peft "
                  f"or a peer differ); --keep-older-rows counts them as done")


def run(exp: Experiment, results_root: str | Path, *, overwrite: bool = False, progress: bool = True,
        command: str = "", stop_after_s: float | None = None, deadline_s: float | None = None,
        point_estimate_s: float | None = None, keep_older: bool = False) -> SweepSummary:
    """Run ``exp``'s unfinished points; ``command`` (the command line that started the sweep) is
    recorded in every row. With ``stop_after_s``, no point starts once that many seconds have
    passed; with ``deadline_s``, no point starts that its estimate says would end later than that
    (``res.point_estimate_s``: its longest earlier wall time on this GPU type, else a margin over
    its wall time on another, at most ``point_estimate_s``, else ``point_estimate_s``, else it
    starts if the deadline has not passed), and a shorter point after it still may. The points not
    started stay unfinished for a rerun (``summary.left``); a point the sweep was stopped in leaves
    a ``stopped_row``. On a GPU, it holds its GPUs' locks throughout (``gpu_lock``): a second sweep
    on them waits, then reads the first one's rows before it decides what is left."""
    started = time.monotonic()
    device_name = detect_device_name(exp.device)
    # the GPUs its points run on, held from before it reads which points are finished until its last row
    gpus = [] if device_name == "cpu" else gpu_lock.visible_gpus(max(exp.gpus))
    limits = [s for s in (stop_after_s, deadline_s) if s is not None]  # a wait spends the sweep's own time
    try:
        with gpu_lock.hold(gpus, command or f"a sweep of {exp.name}",
                           timeout_s=min(limits) - (time.monotonic() - started) if limits else None):
            return _run(exp, results_root, device_name, started, overwrite=overwrite, progress=progress,
                        command=command, stop_after_s=stop_after_s, deadline_s=deadline_s,
                        point_estimate_s=point_estimate_s, keep_older=keep_older)
    except gpu_lock.Busy as e:  # its time went on waiting: every point left for the next call
        sys.stderr.write(f"{e}; no point started (the same command resumes)\n")
        path = res.results_path(results_root, exp.name, res.gpu_slug(device_name))
        done, _ = (set(), "") if overwrite else finished(path, exp.points(), keep_older=keep_older)
        return SweepSummary(results_path=path, left=sum(p.point_id not in done for p in exp.points()))


def _run(exp: Experiment, results_root: str | Path, device_name: str, started: float, *, overwrite: bool,
         progress: bool, command: str, stop_after_s: float | None, deadline_s: float | None,
         point_estimate_s: float | None, keep_older: bool) -> SweepSummary:
    slug = res.gpu_slug(device_name)
    path = res.results_path(results_root, exp.name, slug)
    summary = SweepSummary(results_path=path)
    log_dir = Path(results_root) / exp.name / "logs" / slug
    res.check_writable(path.parent)  # before any point starts, not after its process has run
    existing = res.read_rows(path)  # fails loudly on a corrupt file before anything runs or is written
    keep_experiment_file(exp, results_root)
    points = [dataclasses.replace(p, command=command) for p in exp.points()]
    done, older = (set(), "") if overwrite else finished(path, points, keep_older=keep_older)
    if older:
        sys.stderr.write(older + "\n")

    lane = os.environ.get(LANE_ENV)  # a lane of a sweep over several GPUs: it measured the bandwidth
    if lane is not None:
        term_with_parent()
    else:
        ensure_bandwidth(exp, path, device_name, slug, overwrite=overwrite, existing=existing)

    todo = [p for p in points if p.point_id not in done]
    summary.skipped = len(points) - len(todo)
    recorded = res.point_wall_s(existing)  # this GPU type's earlier wall times: the ETA's first guess
    bar = Progress(len(todo), expected_s=[recorded.get(p.point_id) for p in todo]) if progress else None
    if bar and summary.skipped:
        sys.stderr.write(f"resuming: {summary.skipped} of {len(points)} points already in {path}\n")
    history, elsewhere = res.wall_history(results_root, exp.name, slug) if deadline_s is not None else ({}, {})
    for i, point in enumerate(todo, 1):
        elapsed = time.monotonic() - started
        if stop_after_s is not None and elapsed > stop_after_s:
            summary.left += len(todo) - i + 1
            break
        if deadline_s is not None and \
                elapsed + (res.point_estimate_s(history, point.point_id, point_estimate_s, elsewhere) or 0.0) > deadline_s:
            summary.left += 1
            continue
        if bar:
            bar.start(i, point.label())
        launched_s, began = process_age_s(), time.monotonic()
        try:
            row = for_point(point).run(point, log_dir / f"{point.point_id}.log", bar.step if bar else None)
        except (KeyboardInterrupt, SystemExit):  # the sweep is stopping (Ctrl-C; SIGTERM from `timeout`, which
            # harness.cli turns into SystemExit) with this point running; a crash is not a stop, and says so itself
            res.append_row(path, stopped_row(point, time.monotonic() - began, slug, device_name))
            raise
        if launched_s is not None:  # where the sweep's start-up and earlier points end
            row["launched_s"] = round(launched_s, 3)
        row.update(gpu_slug=slug, device_name=device_name, recorded_at=res.now())
        if lane is not None:
            row["lane"] = lane
        row.setdefault("env", {})
        append_point_row(path, row)
        summary.ran += 1
        summary.statuses[row["status"]] = summary.statuses.get(row["status"], 0) + 1
        if bar:
            bar.finish(row["status"], row)
    return summary
