"""``python -m harness`` / ``packbench``: sweep, report, gate, parity, profile, bandwidth, env."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from harness.errors import InputError
from harness import argtypes
from harness.measure.env import REPO_ROOT
from harness.run import policy

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
  python -m harness gate --base origin/main --head HEAD   # both revisions here, interleaved rounds
  python -m harness gate --baseline results/smoke-gpu/nvidia-h100-80gb-hbm3.jsonl --candidate pr-results/smoke-gpu/
  python -m harness parity experiments/gate.toml   # each switch guard's loss and gradients, on vs off
  python -m harness bandwidth                      # host-to-device GB/s, pinned vs pageable
  python -m harness profile experiments/moe.toml --model gpt-oss-20b --seq-len 2048 --variant grouped_mm-split
  python -m harness env                            # what gets recorded with every run
"""


def default_experiment() -> Path:
    from harness.run.sweep import detect_device_name

    name = "smoke-cpu.toml" if detect_device_name("auto") == "cpu" else "smoke-gpu.toml"
    return EXPERIMENTS / name




def cmd_context(args) -> int:
    from harness.run import context, experiment

    exp = experiment.subset(experiment.load(Path(args.experiment)), models=args.models, variants=args.variants)
    experiment.check_requires(exp)
    import dataclasses

    if args.start:  # where the searches start, in place of the file's first length
        exp = dataclasses.replace(exp, seq_lens=[args.start])
    if args.probe_timeout:  # each probe's time limit, in place of the file's timeout_s
        exp = dataclasses.replace(exp, timeout_s=args.probe_timeout)
    try:
        found = context.run(exp, args.results, max_len=args.max_len, resolution=args.resolution,
                            command=args.command, stop_after_s=args.stop_after, progress=not args.quiet,
                            probe_warmup=args.probe_warmup, probe_steps=args.probe_steps, max_probes=args.probes,
                            keep_older=args.keep_older_rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in found:
        probes = ", ".join(f"{n} {st}" for n, st in s.probes) or "none run"
        print(f"{s.model} {s.variant}: longest trained {s.longest or '-'} tokens (probes this run: {probes})"
              + (f"; {s.stopped}" if s.stopped else ""))
    ended = [s.stopped for s in found if s.stopped and not s.stopped.startswith("stopped:")]
    if any(not why.startswith(context.FAILED_PROBE) for why in ended):
        return 1  # a probe that left no row: the file or the harness is at fault
    return context.ENDED_ON_A_FAILED_PROBE if ended else 0


def cmd_sweep(args) -> int:
    import signal

    from harness.run import experiment

    path = Path(args.experiment) if args.experiment else default_experiment()
    # The file is checked first, before torch is imported: a mistake in it costs no start-up.
    exp = experiment.load(path)
    exp = experiment.subset(exp, models=args.models, seq_lens=args.seq_lens, variants=args.variants)
    if args.launcher and not exp.parallel:  # same point identities: only how the process starts
        exp = dataclasses.replace(exp, launcher=args.launcher)
    if args.timeout is not None:  # not part of a point's identity either
        exp = dataclasses.replace(exp, timeout_s=args.timeout)
    experiment.check_requires(exp)
    if exp.launcher == "preloaded" and not args.cluster and not args.devices:  # lanes: each child its own
        # its fork server imports torch while this process does
        from harness.run import server

        server.start()
    from harness.run import sweep
    from harness.run.stack_dumps import stacks_every

    # `timeout`, a CI runner or a job scheduler stops the sweep with SIGTERM: turn it into an
    # exit that unwinds, so the launcher kills the point in flight (its own session) on the way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:  # every point would fail on it: say so once, before the first
        stacks_every()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sweep {exp.name}: {len(exp.points())} points from {path}", file=sys.stderr)
    if args.devices:  # this host's GPUs as lanes: 2 refused (no report), 1 a group failed
        from harness.run import lanes

        code = lanes.cmd(exp, path, args)
        return code if code == 2 else (_report_after(args, exp) or code)
    if args.cluster == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            print("error: --cluster ray needs Ray: pip install 'ray[default]'", file=sys.stderr)
            return 2
        from harness.run import cluster

        summary = cluster.run(exp, args.results, address=args.ray_address, overwrite=args.overwrite,
                              progress=not args.quiet, command=args.command, resources=args.ray_resources,
                              keep_older=args.keep_older_rows)
    else:
        summary = sweep.run(exp, args.results, overwrite=args.overwrite, progress=not args.quiet, command=args.command,
                            stop_after_s=args.stop_after, deadline_s=args.deadline,
                            point_estimate_s=args.point_estimate, keep_older=args.keep_older_rows)
    print(f"ran {summary.ran}, skipped {summary.skipped} (already finished), statuses {summary.statuses}; rows in {summary.results_path}", file=sys.stderr)
    if summary.left:
        print(f"stopped with {summary.left} points left (--stop-after/--deadline): the same command resumes", file=sys.stderr)
    return _report_after(args, exp)


def _report_after(args, exp) -> int:
    if not args.no_report:
        from harness import report

        readme = report.build_report(args.results, exp.name, args.reports)
        print(f"report: {readme}", file=sys.stderr)
    return 0


def _experiment_name(arg: str) -> str:
    """A report takes experiment names; an experiment file's path stands for its [experiment] name
    (read from the file, so a file named differently from its experiment still finds its rows)."""
    if not arg.endswith(".toml"):
        return arg
    from harness.run import experiment

    return experiment.load(arg).name


def cmd_report(args) -> int:
    from harness import report
    from harness.report import headline

    if args.experiments:
        names = [_experiment_name(a) for a in args.experiments]
        paths = [report.build_report(args.results, name, args.reports) for name in names]
    else:
        paths = report.build_all(args.results, args.reports)
        if args.blog and args.blog.is_file():  # after the reports it links to
            from harness.report.blog import build_blog
            from harness.run.experiment import ExperimentError

            try:
                paths.append(build_blog(args.results, args.reports, args.blog))
            except ExperimentError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        readme = args.reports.parent / "README.md"  # the README beside the reports: its headline block
        text = readme.read_text() if readme.is_file() else ""
        if headline.BEGIN in text or headline.END in text:
            try:
                headline.write(readme, args.results)
            except headline.HeadlineError as e:
                print(f"error: {readme}: {e}", file=sys.stderr)
                return 2
            paths.append(readme)
    for p in paths:
        print(p)
    return 0


def cmd_reproduce(args) -> int:
    from harness import reproduce
    from harness.run.experiment import ExperimentError

    try:
        if args.status:
            return reproduce.status(args.plan, args.status, args.gpu_gib, results=args.results)
        return reproduce.run(args.plan, minutes=args.minutes, results=args.results, dry_run=args.dry_run,
                             steps=args.step)
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


GATE_DESCRIPTION = """\
A regression gate for CI, in one of two modes.

Revisions (--base REV --head REV): check both revisions out into worktrees and sweep the gate
suite (default: head's experiments/gate.toml) with each one's own code on this machine, in
interleaved rounds (base, head, head, base, ...; one fresh sweep per round, raw step samples kept).
Each point's per-round step-time medians and peak memories are compared with a Mann-Whitney U
test; a point fails when its change is significant (p < alpha) and larger than --max-slowdown
(step time) or --max-memory MiB (peak memory), or when it ran ok in base and not in head. Each
switch guard in the suite ([[gate.guards]]) fails when the switch's speedup in head falls below
its floor, or when its on/off loss and gradients differ beyond bf16 tolerance on a fixed batch.
Writes summary.md (a pull-request comment), benchmark.json (github-action-benchmark's
customSmallerIsBetter) and gate.json to --out.

Files (--baseline FILE --candidate FILE): compare a candidate run's results with a committed
baseline's. Points are matched on what they measure; the repeats of a point count as the median
of their step-time p50s. A point fails when its p50 is slower by more than --max-slowdown (with
--noise auto, widened to the spread already seen at that point), its peak memory grew by more
than --max-memory-growth, or it was ok in the baseline and is oom or error in the candidate.
A point on one side only is a warning.

exit codes: 0 pass (warnings allowed), 1 regression or failed guard, 2 unusable input (a missing
or corrupt file, a revision that names no commit, a suite that does not load or that a side
cannot run, nothing to match, or different GPUs without --allow-different-gpu).
"""


def _fraction(text: str) -> float:
    from harness.gate import parse_fraction

    try:
        return parse_fraction(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_gate(args) -> int:
    from harness import gate

    revisions = args.base is not None or args.head is not None
    files = args.baseline is not None or args.candidate is not None
    if revisions == files or (revisions and None in (args.base, args.head)) or (files and None in (args.baseline, args.candidate)):
        print("error: give either --base REV --head REV (measure two revisions here) or --baseline FILE "
              "--candidate FILE (compare two results files)", file=sys.stderr)
        return 2
    if revisions:
        return _gate_revisions(args)

    def write_json(payload: dict) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")

    try:
        result = gate.run(args.baseline, args.candidate, max_slowdown=0.05 if args.max_slowdown is None else args.max_slowdown,
                          max_memory_growth=args.max_memory_growth, noise=args.noise,
                          allow_different_gpu=args.allow_different_gpu)
    except gate.GateError as e:
        print(f"error: {e}", file=sys.stderr)
        write_json({"outcome": "error", "exit_code": 2, "error": str(e)})
        return 2
    print(result.header())
    print(result.table())
    for p in result.failed:
        for reason in p.reasons:
            print(f"FAIL {p.label}: {reason}")
    print(result.summary())
    write_json(result.to_dict())
    return result.exit_code


def _gate_revisions(args) -> int:
    from harness.gate import GateError, outputs, revisions

    out = Path(args.out)
    try:
        report = revisions.run(args.base, args.head, out=out, repo=args.repo, suite=args.suite,
                               rounds_n=args.rounds, alpha=args.alpha, max_slowdown=args.max_slowdown,
                               max_memory_mib=args.max_memory, round_timeout_s=args.round_timeout,
                               fresh_rounds=args.fresh_rounds, command=args.command)
    except Exception as e:  # noqa: BLE001 - whatever stops the gate is an error (exit 2), never a pass or a fail
        if not isinstance(e, GateError):
            e = GateError(f"the gate itself failed ({type(e).__name__}: {e}); rerun with the same --out to resume")
        print(f"error: {e}", file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gate.json").write_text(json.dumps({"outcome": "error", "exit_code": 2, "error": str(e)}, indent=2) + "\n")
        (out / "summary.md").write_text(f"## Performance gate: ERROR\n\nThe gate could not judge this change:\n\n```\n{e}\n```\n")
        return 2
    print(outputs.markdown(report))
    return report.exit_code


def cmd_bandwidth(args) -> int:
    from harness.measure import bandwidth, env

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
    from harness.measure import env

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
    p.add_argument("--keep-older-rows", action="store_true",
                   help="count points finished by other code (optim/harness sources, torch, transformers, peft or "
                        "a peer of other versions) as done; by default the sweep measures them again")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path, help="results root (default: results/)")
    p.add_argument("--reports", default=DEFAULT_REPORTS, type=Path, help="reports root (default: reports/)")
    p.add_argument("--no-report", action="store_true", help="do not rebuild the report afterwards")
    p.add_argument("--stop-after", type=argtypes.seconds_or_zero, metavar="S",
                   help="start no point once S seconds have passed; the rest is left to a rerun (which resumes)")
    p.add_argument("--deadline", type=argtypes.seconds_or_zero, metavar="S",
                   help="start no point that would end after S seconds by its estimate: the longest wall time "
                        "its earlier rows on this GPU type recorded, else half as long again as on another "
                        "(at most --point-estimate), else --point-estimate; a shorter point after it may still start")
    p.add_argument("--point-estimate", type=argtypes.seconds_or_zero, metavar="S",
                   help="with --deadline: what a point never run on this GPU type is expected to take")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--models", nargs="+", help="run only these of the file's models")
    p.add_argument("--seq-lens", nargs="+", type=int, help="run only these of the file's sequence lengths")
    p.add_argument("--variants", nargs="+", help="run only these of the file's variants")
    p.add_argument("--timeout", type=argtypes.seconds, metavar="S",
                   help="override the file's per-point time limit, in seconds; a point past it is "
                        "recorded as an error with its Python stacks in its log")
    p.add_argument("--launcher", choices=policy.LAUNCHERS,
                   help="override the file's launcher: a fresh interpreter per point, or a fork of a "
                        "server that imported torch/transformers/peft once (same isolation)")
    p.add_argument("--devices", nargs="+", metavar="GPUS",
                   help="this host's GPUs as lanes (0 1 2 3; 0,1 2,3 for points of two): each model at each "
                        "length runs its variants in one lane, the lanes at once (harness/run/lanes.py)")
    p.add_argument("--cluster", choices=("ray",),
                   help="spread the points over a Ray cluster, each a task with the point's GPUs; rows come "
                        "back here (harness/run/cluster.py)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="the cluster to join ('auto', ray://host:10001); default: RAY_ADDRESS if set, else a new local Ray")
    p.add_argument("--ray-resources", type=argtypes.resources, metavar="NAME=N[,NAME=N]",
                   help="custom Ray resources each point's task asks for, e.g. one_per_host=1")
    p.set_defaults(func=cmd_sweep)

    from harness.run import context as context_defaults

    p = sub.add_parser("context", help="the longest length each variant trains at: a search over sweep points, "
                                       "one process per probe, an OOM a row")
    p.add_argument("experiment", help="experiment TOML: its models, variants and [data]; its first seq_lens "
                                      "entry is where each search starts")
    p.add_argument("--max-len", type=int, default=context_defaults.MAX_LEN,
                   help=f"the longest length probed (default: {context_defaults.MAX_LEN})")
    p.add_argument("--start", type=argtypes.positive_int, metavar="N",
                   help="start each search at N tokens rather than the file's first length (a search whose "
                        "shorter lengths are known, or not wanted); a search with rows probes N first where N is "
                        "still open (above what trained, below what failed)")
    p.add_argument("--resolution", type=int, default=context_defaults.RESOLUTION,
                   help="stop bisecting once the longest trainable length is known to this many tokens "
                        f"(default: {context_defaults.RESOLUTION})")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path, help="results root (default: results/)")
    p.add_argument("--stop-after", type=argtypes.seconds_or_zero, metavar="S", help="start no probe once S seconds have passed; a rerun goes on")
    p.add_argument("--keep-older-rows", action="store_true",
                   help="go on from probes other code measured (optim/harness sources, torch, transformers, peft or a "
                        "peer of other versions); by default a search counts only this code's rows and starts over")
    p.add_argument("--probes", type=argtypes.positive_int, metavar="N",
                   help="run at most N probes in each search; a rerun goes on (with --start N: one probe at N)")
    p.add_argument("--probe-warmup", type=int, default=1, help="warm-up steps of each probe (default: 1)")
    p.add_argument("--probe-steps", type=int, default=2, help="measured steps of each probe (default: 2)")
    p.add_argument("--probe-timeout", type=argtypes.seconds, metavar="S",
                   help="each probe's time limit in place of the file's timeout_s (a machine lent in calls of a "
                        "few minutes): a probe past it is a timed-out row, the harness's limit, not the card's, "
                        "so the search bisects below it and the report bounds nothing with it; a probe killed "
                        "with its call leaves no row and runs again")
    p.add_argument("--models", nargs="+", help="search only these of the file's models")
    p.add_argument("--variants", nargs="+", help="search only these of the file's variants")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_context)

    p = sub.add_parser("report", help="rebuild reports/ from results/ (reads nothing else)")
    p.add_argument("experiments", nargs="*", help="experiment names, or experiment files standing for their [experiment] name (default: all under results/)")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path, help="results root to read (default: results/)")
    p.add_argument("--reports", default=DEFAULT_REPORTS, type=Path, help="reports root to write (default: reports/)")
    p.add_argument("--blog", default=EXPERIMENTS / "blog.toml", type=Path,
                   help="the plan of reports/README.md, written after every report (default: experiments/blog.toml)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("reproduce", help="run a report plan's sweeps and benches on this GPU, resumably, within a time budget",
                       epilog="exit codes: 0 the plan's runs are done, 3 some are left for a later call (which "
                              "resumes), 2 unusable input")
    p.add_argument("plan", nargs="?", default=EXPERIMENTS / "blog.toml", type=Path,
                   help="the plan (default: experiments/blog.toml)")
    p.add_argument("--minutes", type=argtypes.minutes, default=9.0,
                   help="start nothing that the steps' estimates say would end later than this (default: 9)")
    p.add_argument("--results", default=DEFAULT_RESULTS, type=Path, help="results root (default: results/)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--step", action="append", metavar="NAME",
                   help="run only this step of the plan (its name as --status lists it, without \"(appendix)\"); "
                        "repeat for more, in the plan's order")
    p.add_argument("--status", metavar="GPU", help="what is left on this GPU type (its results/ name, "
                   "e.g. nvidia-h200, or part of one, e.g. h100), from the rows alone; runs nothing and needs no GPU")
    p.add_argument("--gpu-gib", type=float, help="with --status: the GPU's memory (default: what its rows recorded)")
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser(
        "gate", help="CI regression check: compare a candidate's results with a baseline's; exit 1 if slower, bigger or newly failing",
        description=GATE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rev = p.add_argument_group("revisions: measure two git revisions on this machine")
    rev.add_argument("--base", metavar="REV", help="the revision to compare against (e.g. origin/main)")
    rev.add_argument("--head", metavar="REV", help="the revision under test (e.g. HEAD)")
    rev.add_argument("--suite", type=Path, help="gate suite file (default: experiments/gate.toml in head's checkout)")
    rev.add_argument("--rounds", type=argtypes.at_least_two, help="rounds per side (default: the suite's [gate] rounds)")
    rev.add_argument("--alpha", type=argtypes.probability, help="significance level (default: the suite's, 0.01)")
    rev.add_argument("--max-memory", type=argtypes.mib, metavar="MIB", help="allowed peak-memory growth in MiB (default: the suite's, 64)")
    rev.add_argument("--out", default="gate-out", help="where rounds, summary.md, benchmark.json and gate.json go; "
                     "a gate run again with the same --out and revisions resumes (default: gate-out/)")
    rev.add_argument("--repo", type=Path, default=REPO_ROOT, help="the git repository holding both revisions (default: this checkout)")
    rev.add_argument("--round-timeout", type=argtypes.seconds, metavar="S", help="stop the gate (exit 2) if one round runs longer")
    rev.add_argument("--fresh-rounds", action="store_true",
                     help="one fresh sweep process per round, its imports paid every round (default: one per "
                          "side for all its rounds; every point is a fresh process either way)")
    p.add_argument("--max-slowdown", type=_fraction, metavar="PCT", help="allowed step-time slowdown, e.g. 5%% or 0.05 "
                   "(default: 5%%, or the suite's)")
    files = p.add_argument_group("files: compare two results files")
    files.add_argument("--baseline", type=Path, help="results file or directory of the reference run (e.g. a committed results file)")
    files.add_argument("--candidate", type=Path, help="results file or directory of the run under test (e.g. results/<experiment>/)")
    files.add_argument("--max-memory-growth", default="5%", type=_fraction, metavar="PCT", help="allowed peak-memory growth (default: 5%%)")
    files.add_argument("--noise", choices=("auto", "off"), default="auto",
                       help="auto: widen the allowed slowdown at a point to the step-time spread measured there; off: threshold only (default: auto)")
    files.add_argument("--allow-different-gpu", action="store_true", help="compare even though the two sides ran on different GPU types")
    files.add_argument("--json", metavar="FILE", help="also write the verdict and every point to this JSON file (a CI artifact)")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("parity", help="each switch guard of a gate suite: loss and gradients, on vs off, on one fixed batch")
    from harness.run import parity

    parity.add_arguments(p)
    p.set_defaults(func=parity.main)

    p = sub.add_parser("bandwidth", help="host-to-device copy GB/s, pinned vs pageable, 1 MiB-1 GiB (GPU)")
    p.add_argument("--repeats", type=argtypes.positive_int, default=10, help="timed copies per size and memory kind (default: 10)")
    p.add_argument("--json", help="also write the rows and environment to this JSON file")
    p.set_defaults(func=cmd_bandwidth)

    p = sub.add_parser("profile", help="profile one training step of a sweep point: GPU busy %% per phase, launches, syncs, top kernels")
    from harness.run import profile

    profile.add_arguments(p)
    p.set_defaults(func=profile.run)

    p = sub.add_parser("env", help="print the environment recorded with every run")
    p.set_defaults(func=cmd_env)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    # recorded in every row it writes; a lane's child sweep records the command that started the lanes
    args.command = os.environ.get("PACKBENCH_COMMAND") or shlex.join(["python", "-m", "harness", *argv])
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except InputError as e:  # a file, key or value the user can fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the rows written so far stay, and a rerun resumes from them
        print("interrupted: the rows written so far are kept; run the same command again to resume",
              file=sys.stderr)
        return 130
