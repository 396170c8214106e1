"""One sweep at a time on a GPU: a sweep holds a lock on each GPU its points run on for as long as it
reads, runs and records them, so two sweeps (two terminals, two CI jobs on one runner) never time
each other's kernels, and the second one does not run again what the first has just finished.

The locks are advisory file locks (``flock``), one per GPU, named by its UUID: the same card under
any ``CUDA_VISIBLE_DEVICES`` numbering. They exclude the processes that share their folder,
``PACKBENCH_LOCK_DIR`` (default ``/tmp/packbench-gpu-locks``, whatever ``TMPDIR`` says): every
checkout and user of a host, but not a container with a ``/tmp`` of its own, unless the folder is a
mount both see. A sweep that finds its GPU taken says once whose sweep holds it, then waits, at
most until its own time is up (``timeout_s``: what ``--stop-after`` or ``--deadline`` leaves it).
A lock goes with the process that holds it, however that process ends (a kill included), so none
is left behind. ``PACKBENCH_GPU_LOCK=0`` turns the locks off, for a sweep that shares its GPU
knowingly.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import sys
import time
from pathlib import Path

from harness.errors import InputError

DEFAULT_DIR = Path("/tmp/packbench-gpu-locks")
_held: dict[str, int] = {}  # the GPUs this process holds, and how many nested holds hold each


class Busy(Exception):
    """A GPU stayed held by another process past the time a sweep could wait."""


class LockError(InputError):
    """The lock folder or file cannot be used: one line that names it and the way out."""


def lock_dir() -> Path:
    return Path(os.environ.get("PACKBENCH_LOCK_DIR") or DEFAULT_DIR)


def visible_gpus(count: int) -> list[str]:
    """The UUIDs of the first ``count`` GPUs this process sees, in CUDA's numbering, without making
    a CUDA context: at most as many as ``CUDA_VISIBLE_DEVICES`` names where it is set, and only
    those NVML can name for certain; [] where NVML cannot say (no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver here: nothing to lock
        return []
    try:
        every = [_uuid(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return every[:count]
        out = []
        for entry in [v.strip() for v in visible.split(",") if v.strip()][:count]:
            if entry.isdigit():
                found = [every[int(entry)]] if int(entry) < len(every) else []
            else:  # CUDA takes a UUID, with or without its prefix, or any unique start of one
                bare = entry.split("-", 1)[1] if entry.startswith(("GPU-", "MIG-")) else entry
                found = [u for u in every if u.split("-", 1)[-1].startswith(bare)]
                if not found and entry.startswith("MIG-"):  # a MIG slice: NVML names it by its own UUID
                    with contextlib.suppress(pynvml.NVMLError):
                        found = [_uuid(pynvml, pynvml.nvmlDeviceGetHandleByUUID(entry))]
            if len(found) != 1:
                break  # CUDA stops at the first entry it cannot resolve: so does what it sees
            out.append(found[0])
        return out
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def _uuid(pynvml, handle) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def _path(uuid: str) -> Path:
    return lock_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", uuid) + ".lock")


def _open(path: Path):
    """The lock file, opened without following a link; (file, whether its note may be written):
    only a plain file with one name, so a file planted in a shared folder is never written."""
    folder = path.parent
    if not folder.exists():
        try:
            folder.mkdir(parents=True)
            if folder == DEFAULT_DIR:  # every user's sweeps share it, as they share the GPUs
                os.chmod(folder, 0o1777)
        except FileExistsError:
            pass
        except OSError as e:
            raise LockError(f"the GPU lock folder {folder} cannot be made ({e}): set PACKBENCH_LOCK_DIR to a "
                            "folder you can write, or PACKBENCH_GPU_LOCK=0 to run without the lock") from e
    try:
        fd = _fd(path)
    except OSError as e:
        why = "is a symbolic link, where a GPU lock is a plain file" if e.errno == errno.ELOOP else f"cannot be opened ({e})"
        raise LockError(f"the GPU lock {path} {why}: remove it, set PACKBENCH_LOCK_DIR to a folder of your "
                        "own, or PACKBENCH_GPU_LOCK=0 to run without the lock") from e
    st = os.fstat(fd)
    writable = (os.O_ACCMODE & fcntl.fcntl(fd, fcntl.F_GETFL)) == os.O_RDWR
    return os.fdopen(fd, "r+" if writable else "r"), writable and stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _fd(path: Path) -> int:
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
    except FileExistsError:
        try:
            return os.open(path, os.O_RDWR | flags)
        except PermissionError:  # another user's file, kept from us: a lock still, without its note
            return os.open(path, os.O_RDONLY | flags)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # the umask's cut undone: another user's sweep opens it too
    return fd


def _take(f, uuid: str, deadline: float | None, stream) -> None:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    f.seek(0)
    holder = f.read(500).strip() or "another process"
    stream.write(f"GPU {uuid} is in use by {holder}; waiting for it to finish (lock {_path(uuid)})\n")
    stream.flush()
    waited = time.monotonic()
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                raise Busy(f"GPU {uuid} stayed in use by {holder} for the {time.monotonic() - waited:.0f} s "
                           "this sweep could wait") from None
            time.sleep(0.5)
    stream.write(f"GPU {uuid} free after {time.monotonic() - waited:.0f} s\n")
    stream.flush()


@contextlib.contextmanager
def hold(gpus: list[str], what: str, stream=None, timeout_s: float | None = None):
    """Hold every GPU of ``gpus`` (UUIDs) for the ``with`` block, waiting for any that another
    process holds, for at most ``timeout_s`` in all (then ``Busy``); ``what`` tells a sweep that
    waits who holds them. A GPU this process already holds is held again at once; a nested hold
    should add no GPU to those held around it (it would wait out of the one order of all holds)."""
    stream = stream or sys.stderr
    if os.environ.get("PACKBENCH_GPU_LOCK", "1") == "0":
        yield
        return
    deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
    files, mine = [], []
    try:
        for uuid in sorted(set(gpus)):  # one order for every sweep: no two wait on each other
            if uuid in _held:
                mine.append(uuid)
                _held[uuid] = _held.get(uuid, 0) + 1
                continue
            f, note = _open(_path(uuid))
            files.append(f)
            _take(f, uuid, deadline, stream)
            if note:
                f.seek(0)
                f.truncate()
                f.write(f"pid {os.getpid()} ({what}), since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
                f.flush()
            mine.append(uuid)
            _held[uuid] = _held.get(uuid, 0) + 1
        yield
    finally:
        for uuid in mine:
            left = _held.get(uuid, 0) - 1
            if left > 0:
                _held[uuid] = left
            else:
                _held.pop(uuid, None)
        for f in files:
            f.close()  # closing the file releases its lock
