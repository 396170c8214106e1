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

if os.environ.get(ENV) == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
