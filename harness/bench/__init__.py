"""Side-by-side microbenchmarks of one optimization, every mode in one process:
``python -m harness.bench.packing|offload|moe``. Their rows go to ``results/<experiment>/<gpu>.jsonl``
beside the sweep rows (``harness.results.write_bench_rows``), each with the command that wrote it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_store_arguments(ap: argparse.ArgumentParser, experiment: str) -> None:
    from harness.measure.env import REPO_ROOT

    ap.add_argument("--results", type=Path, default=REPO_ROOT / "results", help="results root (default: results/)")
    ap.add_argument("--experiment", default=experiment,
                    help=f"the experiment whose report shows these rows (default: {experiment})")


def store(args, rows: list[dict], env: dict, module: str, argv: list[str] | None) -> Path:
    from harness.results import write_bench_rows

    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", module, *argv])
    return write_bench_rows(args.results, args.experiment, rows, env=env, command=command)
