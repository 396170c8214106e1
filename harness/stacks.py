"""Where was a point when it was stopped? Imported before torch, so it costs nothing to load."""

from __future__ import annotations

import faulthandler
import signal
import sys


def stacks_on_request() -> None:
    """Python stacks of every thread to stderr (the point's log) on a crash, and on SIGUSR1,
    which the launcher sends before it kills a point that timed out or whose sweep is stopping:
    the log then says where a hung point was (importing, compiling, waiting on a kernel)."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
