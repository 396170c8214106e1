"""The GPU suite over this host's GPUs at once: its shards (``--shard K/N``) in one lane per GPU.

Shard 1 holds the tests that need two GPUs and runs first on the first two (on one, where the
selection leaves other tests in it: they must see one GPU); the other shards go,
longest first by ``tests/gpu_durations.json``, to the lane that would be free soonest, and each
lane runs its shards one after another (one pytest process per shard, never two on one GPU: the
recompute tests fill the card on purpose). Logs go under ``--logs``; a table of every shard's
result is printed last, and the exit status is 1 when any shard failed (no tests selected is a pass).

    python3 tools/gpu_suite.py                      # every visible GPU, 7 shards
    python3 tools/gpu_suite.py --gpus 0 1 2 3 --reverse 3 5 7 -- -x
    python3 tools/gpu_suite.py --only 2 6           # a share of them, where one call cannot hold all
    python3 tools/gpu_suite.py --stop-after 420     # start none past 420 s; a line per shard as it ends

``--only`` runs the named shards as the full plan would (shard 1 on two GPUs included) and lists
the others as not run: the suite passes when every share of it has.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PASSING = (0, 5)  # pytest: all passed; no tests collected (a shard of nothing)


def _conftest():
    spec = importlib.util.spec_from_file_location("_suite_conftest", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shard_seconds(n: int) -> list[float]:
    """Each shard's expected wall seconds, from the durations the shards are balanced by (every GPU
    test file is listed there: tests/test_gpu_shards.py sees to it)."""
    conf = _conftest()
    seconds = json.loads(conf.DURATIONS.read_text())["files"] if conf.DURATIONS.exists() else {}
    return [sum(seconds.get(f, conf.UNKNOWN_FILE_S) for f in shard) for shard in conf.shard_files(sorted(seconds), n, seconds)]


def shard_one_needs_two(n: int, extra: list[str]) -> bool:
    """Whether pytest's shard 1 of ``n`` holds only two-GPU files, as it does where they are
    selected: then it sees two GPUs. Anything else in it must see one (with two visible, Trainer
    wraps a model in nn.DataParallel)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", "gpu",
           "--shard", f"1/{n}", *extra]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout
    files = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    return bool(files) and files <= set(_conftest().TWO_GPU_FILES)


def plan(gpus: list[str], seconds: list[float], two: bool = True) -> list[list[tuple[int, str]]]:
    """Per lane (one per GPU), the shards it runs in order, each with the GPUs it sees: shard 1 on
    the first two GPUs where there are two and it needs them (``two``; lane 1 waits for it), the
    rest longest first to the lane that would be free soonest."""
    lanes: list[list[tuple[int, str]]] = [[] for _ in gpus]
    free = [0.0] * len(gpus)
    two = two and len(gpus) > 1 and len(seconds) > 1  # a lone shard holds one-GPU tests too: one GPU
    lanes[0].append((1, ",".join(gpus[:2] if two else gpus[:1])))
    free[0] = seconds[0]
    if two:
        free[1] = seconds[0]
    for k in sorted(range(2, len(seconds) + 1), key=lambda k: (-seconds[k - 1], k)):
        i = min(range(len(gpus)), key=lambda j: (free[j], j))
        lanes[i].append((k, gpus[i]))
        free[i] += seconds[k - 1]
    return lanes


def summary_line(log: str) -> str:
    """pytest's closing line ("3 passed, 1 skipped in 12.00s"), or its last line."""
    lines = [x.strip("= ") for x in log.strip().splitlines() if x.strip()]
    found = [x for x in lines if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)|no tests ran", x)]
    return (found or lines or [""])[-1]


def _pytest(cmd: list[str], log: Path, visible: str, timeout: float | None):
    """pytest's exit status, "timeout" (its whole process group killed: no worker left on the
    GPU), or why it could not start."""
    with open(log, "w") as out:
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
        except OSError as e:
            return f"not started: {e}"
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def run(gpus: list[str], n: int, reverse: set[int], extra: list[str], logs: Path, timeout: float | None,
        only: set[int] | None = None, deadline: float | None = None) -> tuple[list[dict], set[int]]:
    """Every planned shard's result, and the shards not started because ``deadline`` (a
    ``time.time()``) had passed. Each result is also printed as its shard ends, so a run killed
    from outside still shows the shards that finished."""
    lanes = plan(gpus, shard_seconds(n), shard_one_needs_two(n, extra) if len(gpus) > 1 else False)
    if only is not None:  # a share of the suite (one call of several): the planned lanes, less the rest
        lanes = [[(k, v) for k, v in lane if k in only] for lane in lanes]
    logs.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    first_done = threading.Event()
    started, printing, late = time.time(), threading.Lock(), set()

    def shard(k: int, visible: str) -> None:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--no-header", "-rs", "-m", "gpu",
               "--shard", f"{k}/{n}", *(["--reverse"] if k in reverse else []), *extra]
        log = logs / f"shard-{k}-of-{n}.log"
        t0 = time.time()
        try:
            rc = _pytest(cmd, log, visible, timeout)
            summary = summary_line(log.read_text(errors="replace"))
        except Exception as e:  # the runner's own failure is the shard's: never a shard without a result
            rc, summary = f"runner error: {e!r}", ""
        results.append(r := {"shard": k, "gpus": visible, "rc": rc, "seconds": round(time.time() - t0),
                             "summary": summary, "log": str(log)})
        with printing:  # one line at a time from the lanes
            print(f"[{time.time() - started:6.0f} s] {_line(r, n)}", flush=True)

    def lane(i: int) -> None:
        if i == 1 and lanes[0] and lanes[0][0][0] == 1 and "," in lanes[0][0][1]:
            first_done.wait()  # shard 1 sees this GPU too
        for k, visible in lanes[i]:
            try:
                if deadline is not None and time.time() >= deadline:
                    late.add(k)  # not started: the next call's --only runs it
                    continue
                shard(k, visible)
            finally:
                if k == 1:
                    first_done.set()  # whatever became of it: lane 1 must not wait forever

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(gpus))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r["shard"]), late


def _line(r: dict, n: int) -> str:
    return (f"{r['shard']:>3}/{n:<3}  {r['gpus']:<7} {r['seconds']:>5}  {r['summary']}"
            + ("" if r["rc"] in PASSING or r["rc"] == "not run" else f"   [exit {r['rc']}]"))


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES where set (a scheduler's assignment),
    else every one nvidia-smi lists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # --stop-after counts from here: planning runs a pytest collection first
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python3 tools/gpu_suite.py", description=__doc__.split("\n\n")[0],
                                 epilog="pytest arguments after --")
    ap.add_argument("--gpus", nargs="+", default=None, help="the GPUs to use (default: every visible one)")
    ap.add_argument("--shards", type=int, default=7)
    ap.add_argument("--reverse", type=int, nargs="*", default=[], metavar="K", help="shards run in reverse order")
    ap.add_argument("--logs", type=Path, default=None, help="folder for each shard's log (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a shard may run")
    ap.add_argument("--only", type=int, nargs="+", default=None, metavar="K",
                    help="run these shards alone (the suite split over calls; the rest are listed as not run)")
    ap.add_argument("--stop-after", type=float, default=None, metavar="S",
                    help="start no shard once S seconds have passed (a call with a time limit); those are listed as not run")
    args = ap.parse_args(ours)
    gpus = args.gpus if args.gpus is not None else visible_gpus()
    if not gpus:
        ap.error("no GPU: nvidia-smi lists none (name them with --gpus)")
    if args.shards < 1 or any(not 1 <= k <= args.shards for k in args.reverse + (args.only or [])):
        ap.error(f"--shards must be at least 1 and --reverse and --only name shards 1 to {args.shards}")
    only = set(args.only) if args.only else None
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    print(f"logs: {logs}", flush=True)
    deadline = started + args.stop_after if args.stop_after is not None else None
    results, late = run(gpus, args.shards, set(args.reverse), extra, logs, args.timeout, only, deadline)
    got = {r["shard"] for r in results}
    results += [{"shard": k, "gpus": "-", "rc": "not run", "seconds": 0, "summary": "not started (--stop-after)", "log": ""}
                for k in sorted(late)]
    results += [{"shard": k, "gpus": "-", "rc": "no result", "seconds": 0, "summary": "", "log": ""}
                for k in range(1, args.shards + 1) if k not in got | late and (only is None or k in only)]
    results += [{"shard": k, "gpus": "-", "rc": "not run", "seconds": 0, "summary": "not run (--only)", "log": ""}
                for k in range(1, args.shards + 1) if only is not None and k not in only]
    results.sort(key=lambda r: r["shard"])
    width = max(len("result"), *(len(r["summary"]) for r in results))
    print(f"{'shard':>7}  {'GPUs':<7} {'s':>5}  {'result':<{width}}")
    for r in results:
        print(_line(r, args.shards))
    failed = [r["shard"] for r in results if r["rc"] not in PASSING and r["rc"] != "not run"]
    skipped = [r["shard"] for r in results if r["rc"] == "not run"]
    print(("every shard passed" if not skipped else f"every shard run passed; not run: {', '.join(map(str, skipped))}")
          if not failed else f"failed: shard(s) {', '.join(map(str, failed))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
