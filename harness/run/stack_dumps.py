"""Where was a point when it was stopped? Imported before torch, so it costs nothing to load."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

EVERY_ENV = "PACKBENCH_STACKS_EVERY"


def stacks_on_request() -> None:
    """Python stacks of every thread to stderr (the point's log) on a crash, and on SIGUSR1,
    which the launcher sends before it kills a point that timed out or whose sweep is stopping:
    the log then says where a hung point was (importing, compiling, waiting on a kernel).

    With ``PACKBENCH_STACKS_EVERY=<seconds>`` in the environment the stacks are also written
    every that many seconds, so the log of a slow point shows where its time went, not only
    where it was at the end."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    every = stacks_every()
    if every:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)


def stacks_every() -> float | None:
    """The period of ``PACKBENCH_STACKS_EVERY`` in seconds, None when unset or empty."""
    raw = os.environ.get(EVERY_ENV, "").strip()
    if not raw:
        return None
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not every > 0:
        raise ValueError(f"{EVERY_ENV}={raw!r}: give a number of seconds above 0, or leave it unset")
    return every
