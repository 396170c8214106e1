"""Imported first by the fork server of the preloaded launcher (``harness.run.launchers``), and acts
only there (it checks an environment variable the launcher sets for the server's start).

``timeout``, a CI runner or a job scheduler stops a sweep by signalling its whole process group,
and the fork server is in that group. If the server died at once, the point in flight would die
with it (its parent-death signal, ``point._die_with_parent``) before the sweep could ask it for
its Python stacks. So the server ignores SIGTERM. It still exits with the sweep: multiprocessing
closes its "alive" pipe when the sweep process ends. The points it forks get SIGTERM's default
action back (``launchers._preloaded_main``).
"""

import os
import signal

ENV = "PACKBENCH_FORK_SERVER"
# Imported once by the fork server; every point is a fresh fork of it. None of these may touch CUDA
# at import, so each point still creates its own CUDA context, and the allocator reads
# PYTORCH_CUDA_ALLOC_CONF in the point.
PRELOAD = ["harness.run.server", "torch", "transformers", "peft", "harness.run.point"]
_context = None


def preload_modules(find_spec=None) -> list[str]:
    """``PRELOAD``, less peft where bitsandbytes is installed: peft imports it, and bitsandbytes reads
    the GPU's capability at import, which initializes CUDA in the server; no forked point could use
    CUDA then. Each point imports peft itself instead."""
    import importlib.util

    if (find_spec or importlib.util.find_spec)("bitsandbytes") is not None:
        return [m for m in PRELOAD if m != "peft"]
    return list(PRELOAD)


def start():
    """Start the fork server (once per process) and return its multiprocessing context. Cheap to
    call early: the server imports ``PRELOAD`` in its own process, alongside whatever this one
    imports meanwhile; the first fork waits for it."""
    global _context
    if _context is None:
        import multiprocessing
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(preload_modules())
        os.environ[ENV] = "1"  # the server reads it at its start (above)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(ENV, None)
        _context = ctx
    return _context


def start_for(path) -> None:
    """Start the fork server now if the experiment file at ``path`` asks for the preloaded
    launcher, so that its imports run beside the caller's. Any problem with the file is left for
    the caller's own load to report."""
    import tomllib

    try:
        with open(path, "rb") as f:
            launcher = tomllib.load(f).get("experiment", {}).get("launcher")
    except (OSError, ValueError, AttributeError):
        return
    if launcher == "preloaded":
        start()


if os.environ.get(ENV) == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
