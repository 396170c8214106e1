"""Sessions: tests (CPU suite), sweep (the main job), report, gate (GPU regression gate), gpu_tests.

On a CPU machine each session makes its own venv with the CPU wheel of torch, so nothing pulls
the CUDA packages. On a GPU machine that cannot download (a GPU machine with no network), reuse the
preinstalled torch stack with nox's own switch: ``python3 -m nox --no-venv -s sweep``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
ROOT = Path(__file__).parent
CPU_TORCH = "torch==2.13.0"


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _setup(session: nox.Session) -> str:
    """Install the project unless running on the current interpreter; return the python to use."""
    if session.venv_backend == "none":
        session.log("no venv: using this interpreter's preinstalled torch/transformers/peft")
        session.env["PYTHONPATH"] = str(ROOT)
        return sys.executable
    if not _has_nvidia_gpu():
        # Without this, resolving "torch" would pull the default CUDA build (several GB).
        session.install(CPU_TORCH)
    session.install("-e", ".[test]")
    return "python"


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU-marked tests are skipped)."""
    py = _setup(session)
    session.run(py, "-m", "pytest", "-m", "not gpu", *session.posargs)


@nox.session
def sweep(session: nox.Session) -> None:
    """The main job: ``nox -s sweep [-- EXPERIMENT.toml] [--overwrite]``.

    With no experiment it picks the embedded default for the hardware: experiments/smoke-gpu.toml
    on a GPU, experiments/smoke-cpu.toml otherwise. Writes results/ and rebuilds reports/.
    """
    py = _setup(session)
    session.run(py, "-m", "harness", "sweep", *session.posargs)


@nox.session
def report(session: nox.Session) -> None:
    """Rebuild reports/ from results/ (reads nothing else)."""
    py = _setup(session)
    session.run(py, "-m", "harness", "report", *session.posargs)


@nox.session
def gate(session: nox.Session) -> None:
    """The GPU regression gate: ``nox -s gate -- --base origin/main --head HEAD``.

    Checks both revisions out into worktrees and sweeps experiments/gate.toml with each, rounds
    interleaved, on this machine's GPU; writes gate-out/summary.md, benchmark.json and gate.json.
    Exit 1 on a regression or a failed switch guard, 2 on unusable input.
    """
    py = _setup(session)
    args = session.posargs or ["--base", "origin/main", "--head", "HEAD"]
    session.run(py, "-m", "harness", "gate", *args)


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """GPU-marked tests. On a GPU machine with no network: ``python3 -m nox --no-venv -s gpu_tests``."""
    py = _setup(session)
    session.run(py, "-m", "pytest", "-m", "gpu", *session.posargs)
