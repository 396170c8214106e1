"""How a sweep point is isolated: each runs in a fresh process, so an OOM, a crash or a leak in
one point cannot touch the next. A launcher turns a point into a command; ``run`` is shared.

``TorchrunLauncher`` runs a parallel point (``parallel = "fsdp2"``) as one fresh process group:
``torchrun --standalone --nproc-per-node N -m harness _point ...``, one process per GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from harness.measure import env as envmod
from harness.measure import host
from harness.measure.env import REPO_ROOT
from harness.run import policy, server
from harness.run.experiment import SweepPoint
from harness.run.point import PROGRESS_PREFIX, SPAWNED_AT_ENV

OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


class Launcher:
    name = "process"

    def command(self, spec_path: str, out_path: str, point: SweepPoint) -> list[str]:
        return [sys.executable, "-u", "-m", "harness", "_point", spec_path, out_path]

    def run(
        self,
        point: SweepPoint,
        log_path: Path,
        on_progress: Callable[[dict], None] | None = None,
    ) -> dict:
        """Run ``point`` in a child process and return its row; never raises for a bad point."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="packbench-") as tmp:
            spec_path, out_path = os.path.join(tmp, "point.json"), os.path.join(tmp, "row.json")
            Path(spec_path).write_text(point.to_json())
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            env[SPAWNED_AT_ENV] = repr(time.time())  # the point's row says how long it waited to start
            with host.Watch() as watch:  # the host's memory meanwhile, and whether its OOM killer struck
                child = self.spawn(spec_path, out_path, point, env)
                returncode, timed_out = self._supervise(child, log_path, point.timeout_s, on_progress)
            row = None if timed_out else self.result(out_path)  # past its limit: an error, finished or not
            if row is None:
                row = self._failure_row(point, returncode, timed_out, log_path, watch.oom_killed)
            if watch.peak_gib is not None:
                row["host_used_peak_gib"] = round(watch.peak_gib, 2)
            return row

    def result(self, out_path: str) -> dict | None:
        """The row the point's process wrote, if it wrote a whole one (else the point's failure row
        says what its log holds)."""
        if not os.path.exists(out_path):
            return None
        try:
            with open(out_path) as f:
                row = json.load(f)
        except (OSError, ValueError):
            return None
        return row if isinstance(row, dict) else None

    def spawn(self, spec_path: str, out_path: str, point: SweepPoint, env: dict) -> Child:
        """Start the point's process in its own session, stdout and stderr on one pipe."""
        proc = subprocess.Popen(
            self.command(spec_path, out_path, point), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        )
        return Child(proc.pid, proc.stdout, lambda timeout: proc.wait(timeout=timeout))

    def _supervise(self, child: Child, log_path, timeout_s, on_progress) -> tuple[int, bool]:
        last_progress: list[str] = []
        lines = [0]  # output lines so far (to tell whether the stacks came)
        with open(log_path, "w") as log:

            def pump() -> None:
                # a reader thread, so a child that hangs silently still meets the deadline
                for line in child.stdout:
                    lines[0] += 1
                    if line.startswith(PROGRESS_PREFIX):
                        last_progress[:] = [line[len(PROGRESS_PREFIX):].strip()]
                        if on_progress:
                            try:
                                on_progress(json.loads(last_progress[0]))
                            except ValueError:
                                log.write(line)
                    else:
                        log.write(line)
                        log.flush()

            def stop(reason: str, grace_s: float) -> None:
                # the point's stacks into its log first (see harness.run.stack_dumps), then kill
                log.write(f"packbench: {reason}; last progress: {last_progress[0] if last_progress else 'none'}\n")
                log.flush()
                before = lines[0]
                child.dump_stacks(grace_s)
                if lines[0] == before:
                    log.write(f"packbench: no stacks within {grace_s:.0f} s of asking (SIGUSR1): the point was "
                              "not taking signals, e.g. in an uninterruptible driver call\n")
                    log.flush()
                child.kill()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                try:
                    code, timed_out = child.wait(timeout_s), False
                except subprocess.TimeoutExpired:
                    stop(f"timed out after {timeout_s:.0f} s", 2.0)
                    code, timed_out = child.wait(None), True
                reader.join(timeout=10)
                return code, timed_out
            except BaseException:
                # Ctrl-C or a dying parent: take the child (and its children) down with us.
                try:
                    stop("the sweep is stopping", 1.0)
                finally:
                    child.kill()
                raise

    @staticmethod
    def _failure_row(point: SweepPoint, returncode: int, timed_out: bool, log_path: Path,
                     oom_killed: bool | None = None) -> dict:
        """The row of a point whose process wrote none (``death`` says what it died of). The sweep
        process's own ``env`` (``harness.measure.env.light``) says which code measured it."""
        tail = log_path.read_text()[-2000:] if log_path.exists() else ""
        status, message, bound = death(returncode, timed_out, tail, oom_killed, point.timeout_s, "point")
        row = point.new_row().outcome(status, message)
        row.measured["log_tail"] = tail[-1500:]
        if bound:
            row.measured["memory_bound"] = bound
        out = row.to_dict()
        out["env"] = envmod.light()
        return out


def death(returncode: int, timed_out: bool, tail: str, oom_killed: bool | None, timeout_s: float | None,
          what: str = "point") -> tuple[str, str, str | None]:
    """What a process that wrote no result died of: ``(status, message, memory_bound)``.
    ``oom_killed``: whether the kernel's OOM killer ended a process while it ran (None: not known);
    killed by SIGKILL then, it ran the host out of memory, an ``oom`` whose bound is ``host``."""
    if timed_out:
        return "error", f"timed out after {timeout_s:.0f} s", None
    if returncode == -signal.SIGKILL and oom_killed:
        return ("oom", f"out of host memory: the kernel's OOM killer ended the {what} (the machine's memory or "
                "its cgroup's limit)", "host")
    if any(m in tail for m in OOM_MARKERS):
        return "oom", "out of memory (process died; see log)", None
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name
            sig = f"signal {-returncode}"
        guess = {None: " (host out of memory?)", False: " (not by the kernel's OOM killer)"}.get(oom_killed, "")
        return "error", f"killed by {sig}" + (guess if sig == "SIGKILL" else ""), None
    # torchrun's code where the OOM killer ended one of its ranks
    return "error", f"exited with code {returncode} without a result" + (
        "; the kernel's OOM killer ended a process meanwhile (the host's memory?)" if oom_killed else ""), None


class Child:
    """A running point: its pid (also its session and process group), its output lines, and
    ``wait(timeout)`` that returns the exit code (negative: killed by that signal) or raises
    ``subprocess.TimeoutExpired``."""

    def __init__(self, pid: int, stdout, wait: Callable[[float | None], int]):
        self.pid, self.stdout, self.wait = pid, stdout, wait

    def dump_stacks(self, grace_s: float) -> None:
        """Ask the point for its Python stacks (SIGUSR1, see ``harness.run.stack_dumps``) and
        give it ``grace_s`` to write them; a point that exits meanwhile is fine too."""
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError, AttributeError):
            return
        try:
            self.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        # the group (the point and what it started), then the pid itself: a preloaded point
        # killed before its setsid() has no group of its own yet
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ---------------------------------------------------------------------------------------------
# Preloaded: the same isolation without paying the imports per point
# ---------------------------------------------------------------------------------------------

def _preloaded_main(spec_path: str, out_path: str, env: dict, conn) -> None:
    """The point process of ``PreloadedLauncher``: own session, output into the sweep's pipe,
    the sweep's environment of now (the fork server's is that of its start)."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (harness.run.server)
    # multiprocessing hands every forked child the write end of the server's "alive" pipe, so a
    # child would keep the server (its parent) running after the sweep died, and the point's
    # parent-death signal would never fire. Only the sweep holds it now.
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    for fd in (1, 2):
        os.dup2(conn.fileno(), fd)
    conn.close()
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    code = run_forked_point(spec_path, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # through multiprocessing's exit: its finalizers release the point's semaphores


FRESH_NOTE = ("preloaded launcher: an import in the fork server initialized CUDA, which a forked point cannot "
              "use; this point runs as a fresh process, as launcher = \"process\" starts it")


def run_forked_point(spec_path: str, out_path: str) -> int:
    """A forked point's run. Where the fork server's imports initialized CUDA (a package that reads
    the GPU at import: ``harness.run.server.preload_modules`` leaves out the one known), the fork
    cannot use CUDA: the process replaces itself with a fresh interpreter running the point (same
    pid, pipes and environment), with one line on its log, rather than fail."""
    import torch

    if torch.cuda._is_in_bad_fork():
        print(FRESH_NOTE, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.chdir(REPO_ROOT)
        os.execve(sys.executable, Launcher().command(spec_path, out_path, None), dict(os.environ))
    from harness.run import point

    return point.main(spec_path, out_path)


class PreloadedLauncher(Launcher):
    """Each point in a fresh process forked from a server that has imported torch,
    transformers and peft once: the isolation of ``process`` without ~5-15 s of imports per
    point. An OOM, a crash or a leak still ends with the point's own process.

    Environment variables that a preloaded module reads at import time take the value the
    sweep had when the fork server started (its first point); everything read later, including
    OPTIM_* and PYTORCH_CUDA_ALLOC_CONF, takes the sweep's value at each point.
    """

    name = "preloaded"

    def spawn(self, spec_path: str, out_path: str, point: SweepPoint, env: dict) -> Child:
        ctx = server.start()
        r, w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_preloaded_main, args=(spec_path, out_path, env, w), daemon=False)
        proc.start()
        w.close()
        stdout = os.fdopen(os.dup(r.fileno()), "r", buffering=1, errors="replace")
        r.close()

        def wait(timeout: float | None) -> int:
            proc.join(timeout)
            if proc.exitcode is None:
                raise subprocess.TimeoutExpired("preloaded point", timeout or 0)
            return proc.exitcode

        return Child(proc.pid, stdout, wait)


# ---------------------------------------------------------------------------------------------
# Torchrun: one process per GPU for a parallel point
# ---------------------------------------------------------------------------------------------

class TorchrunLauncher(Launcher):
    """A parallel point as one fresh process group: torchrun on this host, ``gpus`` ranks on a
    free port of its own (``--standalone``). Rank 0 writes the row; a rank that fails writes its
    own and exits, torchrun stops the rest, and the point's row is the failed rank's (an OOM in
    any rank is the point's OOM). A point past its time limit is killed with its whole group."""

    name = "torchrun"

    def command(self, spec_path: str, out_path: str, point: SweepPoint) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={point.gpus}",
                "--max-restarts=0", "-m", "harness", "_point", spec_path, out_path]

    def result(self, out_path: str) -> dict | None:
        failed = []
        for path in sorted(Path(out_path).parent.glob(Path(out_path).name + ".rank*")):
            with open(path) as f:
                failed.append(json.load(f))
        if failed:  # what went wrong first is a failed rank's own row; an OOM anywhere is the point's
            return next((r for r in failed if r.get("status") == "oom"), failed[0])
        return super().result(out_path)


LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (Launcher, PreloadedLauncher, TorchrunLauncher)}
assert tuple(LAUNCHERS) == policy.LAUNCHERS + policy.MULTI_GPU_LAUNCHERS, "harness.run.policy lists the launchers"


def for_point(point: SweepPoint) -> Launcher:
    return LAUNCHERS[point.launcher]()
