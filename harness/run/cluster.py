"""One sweep spread over a Ray cluster: ``python -m harness sweep FILE --cluster ray``.

Ray places each unfinished point as a task asking for the point's GPUs (``num_gpus``, CPU points
ask for one CPU): on a laptop, on one GPU box (``ray.init()`` there), or on a Ray cluster on
Slurm or Kubernetes (``--ray-address``). Inside its task a point runs exactly as in a local sweep,
through its launcher (``harness.run.launchers``): a fresh process, or a torchrun group for a
parallel point, so an OOM or a crash is still that point's row. Ray hands the task its GPUs
(``CUDA_VISIBLE_DEVICES``), and the point's process inherits them.

Rows come back to this process, which appends each one atomically as its task ends, into the
results file of the GPU that ran it; the point's log comes back with it. A task that Ray loses
(its worker or node died) is an error row and the sweep goes on. Resume is the local sweep's:
a point already finished (ok or oom) by this code in any of the experiment's results files is not
submitted (``harness.run.sweep.finished``).

Points that share a machine run at once when its GPUs allow: each has its own GPUs, but they
share the host's CPUs and PCIe links, which host-bound points feel. Pin such a sweep to one
point per machine with a custom resource (see ``--ray-resources``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from harness import results as res
from harness.measure.env import REPO_ROOT
from harness.run import sweep as sweepmod
from harness.run.experiment import Experiment, SweepPoint

# what a point reads from the environment travels with its task
FORWARDED_ENV_PREFIXES = ("OPTIM_", "PACKBENCH_", "PYTORCH_CUDA_ALLOC_CONF", "TORCHINDUCTOR_", "TRITON_")
TASK_FAULT_ENV = "PACKBENCH_TASK_FAULT"  # tests: "variant" makes that point's Ray worker die


def run_point_task(point_json: str) -> dict:
    """The body of one point's Ray task: run it through its launcher on this node; the row, the
    GPU it ran on and its log."""
    import socket

    point = SweepPoint.from_json(point_json)
    if os.environ.get(TASK_FAULT_ENV) == point.variant:
        os._exit(1)
    from harness.run.launchers import for_point

    device_name = sweepmod.detect_device_name(point.device)
    with tempfile.TemporaryDirectory(prefix="packbench-ray-") as tmp:
        log_path = Path(tmp) / "point.log"
        row = for_point(point).run(point, log_path)
        log = log_path.read_text() if log_path.exists() else ""
    return {"row": row, "device_name": device_name, "log": log, "node": socket.gethostname()}


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def connect(address: str | None = None, **init_kwargs) -> None:
    """Join ``address`` (None: RAY_ADDRESS, else a new local Ray) unless this process already has:
    on a remote cluster this checkout is shipped to the workers, locally they import it in place."""
    import ray

    if ray.is_initialized():
        return
    if address and address not in ("local", "auto"):  # another machine: ship this checkout
        runtime_env = {"working_dir": str(REPO_ROOT),
                       "excludes": [".git", ".venv", "results", "reports", "gate-out", "*.whl"]}
    else:
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}}
    ray.init(address=None if address == "local" else address, runtime_env=runtime_env,
             include_dashboard=False, log_to_driver=False, **init_kwargs)


def _local_device(requested: str) -> str:
    """Where a lost task's row goes before any task reported its GPU: this machine's, if any."""
    try:
        return sweepmod.detect_device_name(requested)
    except RuntimeError:
        return "unknown"


def _finished(root: Path, experiment: str, points, keep_older: bool) -> set[str]:
    done: set[str] = set()
    for path in sorted((root / experiment).glob("*.jsonl")):
        ids, older = sweepmod.finished(path, points, keep_older=keep_older)
        if older:
            print(f"{path.name}: {older}", file=sys.stderr)
        done |= ids
    return done


def run(exp: Experiment, results_root: str | Path, *, address: str | None = None, overwrite: bool = False,
        progress: bool = True, command: str = "", resources: dict[str, float] | None = None,
        keep_older: bool = False) -> sweepmod.SweepSummary:
    """Run ``exp``'s unfinished points as Ray tasks; rows appended as each ends. Connects to
    ``address`` (a running cluster, "auto") or starts a local Ray, unless one is initialized."""
    import ray

    root = Path(results_root)
    sweepmod.keep_experiment_file(exp, root)
    for path in (root / exp.name).glob("*.jsonl"):
        res.read_rows(path)  # a corrupt file stops the sweep before anything is submitted
    points = [dataclasses.replace(p, command=command) for p in exp.points()]
    done = set() if overwrite else _finished(root, exp.name, points, keep_older)
    todo = [p for p in points if p.point_id not in done]
    summary = sweepmod.SweepSummary(results_path=root / exp.name, skipped=len(points) - len(todo))
    if not todo:
        return summary
    connect(address)
    gpus_here = ray.cluster_resources().get("GPU", 0) > 0
    task = ray.remote(run_point_task)
    pending = {}
    for point in todo:
        wants_gpu = point.device == "cuda" or (point.device == "auto" and gpus_here)
        opts = {"num_gpus": point.gpus if wants_gpu else 0, "num_cpus": 1, "max_retries": 0,
                "resources": dict(resources or {}),
                # what the point reads from the environment now (merged into the job's)
                "runtime_env": {"env_vars": _forwarded_env()}}
        pending[task.options(**opts).remote(point.to_json())] = point
    bar = sweepmod.Progress(len(todo)) if progress else None
    last_device = None
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        point = pending.pop(ref)
        try:
            out = ray.get(ref)
        except ray.exceptions.RayError as e:  # the task, its worker or its node was lost
            row = point.new_row().to_dict()
            row["message"] = f"ray: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            out = {"row": row, "device_name": last_device or _local_device(exp.device), "log": str(e)[-4000:],
                   "node": None}
        row = out["row"]
        last_device = out["device_name"]
        slug = res.gpu_slug(out["device_name"])
        row.update(gpu_slug=slug, device_name=out["device_name"], recorded_at=res.now(), node=out["node"])
        row.setdefault("env", {})
        sweepmod.append_point_row(res.results_path(root, exp.name, slug), row)
        log_path = root / exp.name / "logs" / slug / f"{point.point_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(out["log"])
        summary.ran += 1
        summary.statuses[row["status"]] = summary.statuses.get(row["status"], 0) + 1
        if bar:
            bar.start(summary.ran, point.label())
            bar.finish(row["status"], row)
    return summary
