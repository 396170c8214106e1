"""One sweep at a time on a GPU: a sweep holds a lock on each GPU its points run on for as long as it
reads, runs and records them, so two sweeps (two terminals, two CI jobs on one runner) never time
each other's kernels, and the second one does not run again what the first has just finished.

The locks are advisory file locks (``flock``), one per GPU, named by its UUID: the same card under
any ``CUDA_VISIBLE_DEVICES`` numbering, from any checkout on the host. They live in
``PACKBENCH_LOCK_DIR`` (default ``<tmp>/packbench-gpu-locks``). A sweep that finds its GPU taken
says once whose sweep holds it, then waits. A lock goes with the process that holds it, however it
ends (a kill included), so none is left behind. ``PACKBENCH_GPU_LOCK=0`` turns the locks off, for a
sweep that shares its GPU knowingly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tempfile
import time
from pathlib import Path

_held: dict[str, int] = {}  # the GPUs this process holds, and how many nested holds hold each


def lock_dir() -> Path:
    return Path(os.environ.get("PACKBENCH_LOCK_DIR") or Path(tempfile.gettempdir()) / "packbench-gpu-locks")


def visible_gpus(count: int) -> list[str]:
    """The UUIDs of the first ``count`` GPUs this process sees, in CUDA's numbering, without making
    a CUDA context; [] where NVML cannot say (no driver)."""
    try:
        import pynvml

        from harness.measure.env import nvml_handle

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver here: nothing to lock
        return []
    try:
        uuids = []
        for i in range(count):
            uuid = pynvml.nvmlDeviceGetUUID(nvml_handle(pynvml, i))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return uuids
    except Exception:  # noqa: BLE001 - fewer GPUs than asked: the point itself will say so
        return uuids
    finally:
        pynvml.nvmlShutdown()


def _path(uuid: str) -> Path:
    return lock_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", uuid) + ".lock")


def _open(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # every user's sweeps share the folder, as they share the GPUs
        os.chmod(path.parent, 0o1777)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    return os.fdopen(fd, "r+")


@contextlib.contextmanager
def hold(gpus: list[str], what: str, stream=None):
    """Hold every GPU of ``gpus`` (UUIDs) for the ``with`` block, waiting for any another process
    holds; ``what`` says who holds them to a sweep that waits. A GPU this process already holds
    is held again at once."""
    stream = stream or sys.stderr
    if os.environ.get("PACKBENCH_GPU_LOCK", "1") == "0":
        yield
        return
    files, mine = [], []
    try:
        for uuid in sorted(set(gpus)):  # one order for every sweep: no two wait on each other
            if uuid in _held:
                _held[uuid] += 1
                mine.append(uuid)
                continue
            f = _open(_path(uuid))
            files.append(f)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                stream.write(f"GPU {uuid} is in use by {holder}; waiting for it to finish "
                             f"(lock {_path(uuid)})\n")
                stream.flush()
                waited = time.monotonic()
                fcntl.flock(f, fcntl.LOCK_EX)
                stream.write(f"GPU {uuid} free after {time.monotonic() - waited:.0f} s\n")
                stream.flush()
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} ({what}), since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
            f.flush()
            _held[uuid] = 1
            mine.append(uuid)
        yield
    finally:
        for uuid in mine:
            _held[uuid] -= 1
            if _held[uuid] == 0:
                del _held[uuid]
        for f in files:
            f.close()  # closing the file releases its lock
