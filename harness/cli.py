"""``python -m harness`` / ``packbench``: sweep, report, bandwidth, env."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.env import REPO_ROOT

EXPERIMENTS = REPO_ROOT / "experiments"
DEFAULT_RESULTS = REPO_ROOT / "results"
DEFAULT_REPORTS = REPO_ROOT / "reports"

DESCRIPTION = """\
Benchmark LLM fine-tuning steps and the optimizations in `optim`.

A sweep reads an experiment file (TOML, see experiments/), runs every point (model x sequence
length x switch variant) in its own fresh process, appends one JSON row per point to
results/<experiment>/<gpu>.jsonl, and rebuilds reports/<experiment>/README.md from results/.
"""

EPILOG = """\
examples:
  python -m harness sweep                          # embedded default: smoke-gpu on a GPU, smoke-cpu otherwise
  python -m harness sweep experiments/smoke-gpu.toml --overwrite
  python -m harness report                         # rebuild every report from results/
  python -m harness bandwidth                      # host-to-device GB/s, pinned vs pageable
  python -m harness env                            # what gets recorded with every run
"""


def default_experiment() -> Path:
    from harness.sweep import detect_device_name

    name = "smoke-cpu.toml" if detect_device_name("auto") == "cpu" else "smoke-gpu.toml"
    return EXPERIMENTS / name


def cmd_sweep(args) -> int:
    from harness import experiment, sweep

    path = Path(args.experiment) if args.experiment else default_experiment()
    try:
        exp = experiment.load(path)
    except experiment.ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        exp = experiment.subset(exp, models=args.models, seq_lens=args.seq_lens, variants=args.variants)
    except experiment.ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sweep {exp.name}: {len(exp.points())} points from {path}", file=sys.stderr)
    summary = sweep.run(exp, args.results, overwrite=args.overwrite, progress=not args.quiet)
    print(f"ran {summary.ran}, skipped {summary.skipped} (already finished), statuses {summary.statuses}; rows in {summary.results_path}", file=sys.stderr)
    if not args.no_report:
        from harness import report

        readme = report.build_report(args.results, exp.name, args.reports)
        print(f"report: {readme}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from harness import report

    if args.experiments:
        paths = [report.build_report(args.results, name, args.reports) for name in args.experiments]
    else:
        paths = report.build_all(args.results, args.reports)
    for p in paths:
        print(p)
    return 0


def cmd_bandwidth(args) -> int:
    from harness import bandwidth, env

    rows = bandwidth.measure_h2d(repeats=args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "env": env.collect()}))
    print(f"{'memory':9} {'size':>9} {'GB/s p50':>9} {'p20':>7} {'p80':>7}")
    for r in rows:
        g = r["gbps"]
        print(f"{r['memory']:9} {r['size_bytes'] / 2**20:7.0f}Mi {g['p50']:9.2f} {g['p20']:7.2f} {g['p80']:7.2f}")
    ceiling = rows[0]["pcie_ceiling_gbps"] if rows else None
    print(f"PCIe ceiling: {ceiling:.1f} GB/s (gen {rows[0]['pcie_gen']} x{rows[0]['pcie_width']})" if ceiling else "PCIe ceiling: unknown")
    return 0


def cmd_env(args) -> int:
    from harness import env

    print(json.dumps(env.collect(), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("sweep", help="run an experiment file and write its results and report")
    p.add_argument("experiment", nargs="?", help="experiment TOML (default: smoke-gpu.toml on a GPU, smoke-cpu.toml otherwise)")
    p.add_argument("--overwrite", action="store_true", help="rerun points that already have results")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path, help="results root (default: results/)")
    p.add_argument("--reports", default=DEFAULT_REPORTS, type=Path, help="reports root (default: reports/)")
    p.add_argument("--no-report", action="store_true", help="do not rebuild the report afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--models", nargs="+", help="run only these of the file's models")
    p.add_argument("--seq-lens", nargs="+", type=int, help="run only these of the file's sequence lengths")
    p.add_argument("--variants", nargs="+", help="run only these of the file's variants")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="rebuild reports/ from results/ (reads nothing else)")
    p.add_argument("experiments", nargs="*", help="experiment names (default: all under results/)")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path)
    p.add_argument("--reports", default=DEFAULT_REPORTS, type=Path)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bandwidth", help="host-to-device copy GB/s, pinned vs pageable, 1 MiB-1 GiB (GPU)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="also write the rows and environment to this JSON file")
    p.set_defaults(func=cmd_bandwidth)

    p = sub.add_parser("env", help="print the environment recorded with every run")
    p.set_defaults(func=cmd_env)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_point"]:  # internal: the child process of one sweep point
        from harness import point

        return point.main(*argv[1:3])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)
