"""A sweep process that stays for several sweeps of one experiment file: the gate's rounds.

``python -m harness _rounds SUITE`` imports what a sweep needs, starts the fork server if the file
asks for the preloaded launcher, prints ``{"ready": 1}`` and then reads requests, one JSON line
each on stdin: ``{"argv": [...], "log": PATH}``, the arguments of one ``python -m harness
sweep``. It runs that sweep in-process, its output into ``log``, and answers ``{"exit": CODE}``.
End of input ends it.

Every point is still a fresh process, forked from a server that only imported; what the rounds
share is this driver, which holds no CUDA context, and that server. A gate pays the imports once
per side instead of once per round: 16-20 s per round on an H100 host where a round's two
judged points run ~25 s. Protocol lines go to the stdout this process was started with; anything
else printed goes to the request's log (or stderr between requests).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path

PROTOCOL = 1


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not reach the protocol
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    if len(argv) != 1:
        print("usage: python -m harness _rounds SUITE", file=sys.stderr)
        return 2
    from harness import cli
    from harness.run import server

    suite = Path(argv[0])
    server.start_for(suite)
    from harness.run import experiment, sweep  # noqa: F401 - what each round's sweep would import

    proto.write(json.dumps({"ready": PROTOCOL}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            args, log_path = list(req["argv"]), req["log"]
        except (ValueError, KeyError, TypeError) as e:
            proto.write(json.dumps({"exit": 2, "error": f"bad request: {e}"}) + "\n")
            continue
        code = _sweep(cli, args, log_path)
        proto.write(json.dumps({"exit": code}) + "\n")
        if code == 128 + signal.SIGTERM:  # stopped from outside: stop serving too
            return code
    return 0


def _sweep(cli, args: list[str], log_path: str) -> int:
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            return cli.main(["sweep", *args])
        except SystemExit as e:  # argparse, or SIGTERM through cmd_sweep's handler
            return e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - one failed round is the gate's to report, not a dead server
            traceback.print_exc()
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
