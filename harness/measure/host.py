"""The host's memory while a point runs, read by the sweep process beside the point's own.

A long sequence that offloads its checkpoints holds them in host memory, so a point can die of
the host's memory as well as the GPU's. The kernel's OOM killer then ends it with SIGKILL, and
the point writes no row of its own. ``Watch`` runs beside the point: it samples the memory the
host has in use and reads the kernel's count of OOM kills before and after, so the sweep can tell
such a death (``oom_killed``) from any other SIGKILL and record how full the host got.

Linux only (``/proc``); elsewhere every reading is None and ``oom_killed`` is None: not known.
"""

from __future__ import annotations

import threading
from pathlib import Path

INTERVAL_S = 0.2  # between samples: the pinned buffers of a long probe grow over seconds


def oom_kills(vmstat: Path | str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (``oom_kill`` of
    /proc/vmstat: global and cgroup OOM kills alike), None where the kernel does not say."""
    try:
        for line in Path(vmstat).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def used_gib(meminfo: Path | str = "/proc/meminfo") -> float | None:
    """The host's memory in use, MemTotal − MemAvailable of /proc/meminfo, in GiB: what the host
    could not hand to a new allocation without reclaiming (every process's, not one's)."""
    fields: dict[str, int] = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
                fields[key] = int(parts[0])
    except OSError:
        return None
    if len(fields) < 2:
        return None
    return (fields["MemTotal"] - fields["MemAvailable"]) * 1024 / 2**30  # the kernel counts kB (KiB)


class Watch:
    """``with Watch() as w: ...``: samples ``used_gib`` every ``interval_s`` on a thread while the
    block runs. After it, ``peak_gib`` is the largest sample (None where none could be read) and
    ``oom_killed`` whether the kernel's OOM killer ended a process meanwhile (None: not known)."""

    def __init__(self, interval_s: float = INTERVAL_S, vmstat: Path | str = "/proc/vmstat",
                 meminfo: Path | str = "/proc/meminfo"):
        self.interval_s, self.vmstat, self.meminfo = interval_s, vmstat, meminfo
        self.peak_gib: float | None = None
        self.oom_killed: bool | None = None
        self._kills: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        used = used_gib(self.meminfo)
        if used is not None and (self.peak_gib is None or used > self.peak_gib):
            self.peak_gib = used

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "Watch":
        self._kills = oom_kills(self.vmstat)
        self._sample()
        self._thread = threading.Thread(target=self._run, name="packbench-host-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        after = oom_kills(self.vmstat)
        self.oom_killed = None if self._kills is None or after is None else after > self._kills
