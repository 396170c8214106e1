"""How a sweep point is isolated: each runs in a fresh process, so an OOM, a crash or a leak in
one point cannot touch the next. A launcher turns a point into a command; ``run`` is shared.

A torchrun launcher for several GPUs per point subclasses ``Launcher`` and overrides
``command`` (``torchrun --nproc-per-node N -m harness _point ...``); nothing else changes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from harness.env import REPO_ROOT
from harness.experiment import SweepPoint
from harness.point import PROGRESS_PREFIX

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
            cmd = self.command(spec_path, out_path, point)
            returncode, timed_out = self._supervise(cmd, env, log_path, point.timeout_s, on_progress)
            if os.path.exists(out_path):
                with open(out_path) as f:
                    return json.load(f)
            return self._failure_row(point, returncode, timed_out, log_path)

    def _supervise(self, cmd, env, log_path, timeout_s, on_progress) -> tuple[int, bool]:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1, start_new_session=True,
            )

            def pump() -> None:
                # a reader thread, so a child that hangs silently still meets the deadline
                for line in proc.stdout:  # type: ignore[union-attr]
                    if line.startswith(PROGRESS_PREFIX):
                        if on_progress:
                            try:
                                on_progress(json.loads(line[len(PROGRESS_PREFIX):]))
                            except ValueError:
                                log.write(line)
                    else:
                        log.write(line)
                        log.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                try:
                    code, timed_out = proc.wait(timeout=timeout_s), False
                except subprocess.TimeoutExpired:
                    self._kill(proc)
                    code, timed_out = proc.wait(), True
                reader.join(timeout=10)
                return code, timed_out
            except BaseException:
                # Ctrl-C or a dying parent: take the child (and its children) down with us.
                self._kill(proc)
                raise

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @staticmethod
    def _failure_row(point: SweepPoint, returncode: int, timed_out: bool, log_path: Path) -> dict:
        tail = log_path.read_text()[-2000:] if log_path.exists() else ""
        if timed_out:
            status, message = "error", f"timed out after {point.timeout_s:.0f} s"
        elif any(m in tail for m in OOM_MARKERS):
            status, message = "oom", "out of memory (process died; see log)"
        elif returncode < 0:
            sig = signal.Signals(-returncode).name
            status, message = "error", f"killed by {sig}" + (" (host out of memory?)" if sig == "SIGKILL" else "")
        else:
            status, message = "error", f"exited with code {returncode} without a result"
        return {
            "kind": "step", "point_id": point.point_id, "experiment": point.experiment,
            "model": point.model, "seq_len": point.seq_len, "batch_size": point.batch_size,
            "variant": point.variant, "baseline_variant": point.baseline_variant,
            "switches": point.switches, "gpus": point.gpus, "repeat": point.repeat,
            "warmup_steps": point.warmup_steps, "measured_steps": point.measured_steps,
            "lora_rank": point.lora_rank, "dtype": point.dtype,
            "status": status, "message": message, "log_tail": tail[-1500:],
        }


LAUNCHERS: dict[str, type[Launcher]] = {"process": Launcher}


def for_point(point: SweepPoint) -> Launcher:
    return LAUNCHERS[point.launcher]()
