"""Every bad input a newcomer can give the command line gets one `error:` line naming the file,
key or value and what is wrong, exit code 2, and leaves every file as it was."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from harness.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = """
[experiment]
name = "tiny"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
warmup_steps = 3
measured_steps = 10
dtype = "fp32"
device = "cpu"
baseline = "stock"

[variants.stock]
role = "stock"
"""


def _md5s(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _truncated_results(tmp: Path) -> Path:
    """results/packing with its H100 file cut in the middle of a row."""
    results = tmp / "results"
    shutil.copytree(ROOT / "results" / "packing", results / "packing")
    f = results / "packing" / "nvidia-h100-80gb-hbm3.jsonl"
    data = f.read_bytes()
    f.write_bytes(data[: data.index(b"\n", len(data) // 2) + 40])
    return results


def _tiny_with_truncated_rows(tmp: Path) -> list[str]:
    exp = tmp / "tiny.toml"
    exp.write_text(TINY)
    rows = tmp / "results" / "tiny" / "cpu.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text('{"kind": "step", "status": "ok", "point_id": "a"}\n{"kind": "st')
    return ["sweep", str(exp), "--results", str(tmp / "results"), "--no-report", "--quiet"]


def _tiny_with_rows(text: bytes):
    def build(tmp: Path) -> list[str]:
        exp = tmp / "tiny.toml"
        exp.write_text(TINY)
        rows = tmp / "results" / "tiny" / "cpu.jsonl"
        rows.parent.mkdir(parents=True)
        rows.write_bytes(text)
        return ["sweep", str(exp), "--results", str(tmp / "results"), "--no-report", "--quiet"]
    return build


def _tiny_on(device: str, *flags: str):
    def build(tmp: Path) -> list[str]:
        exp = tmp / "tiny.toml"
        exp.write_text(TINY.replace('device = "cpu"', f'device = "{device}"'))
        return ["sweep", str(exp), "--results", str(tmp / "results"), "--no-report", "--quiet", *flags]
    return build


def _bad_switch(tmp: Path) -> list[str]:
    exp = tmp / "bad.toml"
    exp.write_text(TINY + "packing_cache = 1\n")
    return ["sweep", str(exp), "--results", str(tmp / "results"), "--quiet"]


def _results_root_is_a_file(tmp: Path) -> list[str]:
    exp = tmp / "tiny.toml"
    exp.write_text(TINY)
    (tmp / "results").write_text("not a folder\n")
    return ["sweep", str(exp), "--results", str(tmp / "results"), "--quiet"]


def _read_only_results(tmp: Path) -> list[str]:
    exp = tmp / "tiny.toml"
    exp.write_text(TINY)
    (tmp / "results").mkdir()
    os.chmod(tmp / "results", 0o555)
    return ["sweep", str(exp), "--results", str(tmp / "results"), "--quiet"]


CASES = {
    # name: (argv builder, what the one line must say)
    "report on a truncated results file": (
        lambda t: ["report", "packing", "--results", str(_truncated_results(t)), "--reports", str(t / "reports")],
        r"nvidia-h100-80gb-hbm3\.jsonl:\d+: not a whole result row"),
    "sweep over a truncated results file": (_tiny_with_truncated_rows, r"cpu\.jsonl:2: not a whole result row"),
    "sweep over a results file holding a JSON list": (_tiny_with_rows(b'{"kind": "step"}\n[1, 2]\n'),
                                                      r"cpu\.jsonl:2: a result row is a JSON object"),
    "sweep over a results file that is not UTF-8": (_tiny_with_rows(b'{"kind": "st\xff\xfe"}\n'), r"cpu\.jsonl: not UTF-8"),
    "a CUDA experiment on a machine without a GPU": (_tiny_on("cuda"), r"asks for device 'cuda' but no NVIDIA GPU"),
    "a time limit that is not a finite time": (_tiny_on("cpu", "--stop-after", "nan"), r"expected a finite number of seconds, 0 or more, got 'nan'"),
    "report of an experiment with no rows": (
        lambda t: ["report", "nosuchexp", "--results", str(_truncated_results(t).parent / "results"),
                   "--reports", str(t / "reports")],
        r"no result rows for experiment 'nosuchexp'.*experiments with rows: packing"),
    "a bool switch given 1": (_bad_switch, r"packing_cache\] 1 is not a valid choice"),
    "a results root that is a file": (_results_root_is_a_file, r"cannot write results there"),
    "a read-only results folder": (_read_only_results, r"results: cannot write results there"),
    "profile with no profiled steps": (
        lambda t: ["profile", str(ROOT / "experiments" / "smoke-cpu.toml"), "--model", "qwen3-0.6b-tiny",
                   "--seq-len", "256", "--variant", "sdpa", "--steps", "0"],
        r"--steps: 0 is below 1"),
    "bandwidth on a machine without a GPU": (lambda t: ["bandwidth"], r"this machine has none"),
    "bandwidth with no repeats": (lambda t: ["bandwidth", "--repeats", "0"], r"--repeats: 0 is not 1 or more"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    if case == "a read-only results folder" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder; 'a results root that is a file' covers the check")
    if case in ("bandwidth on a machine without a GPU", "a CUDA experiment on a machine without a GPU") \
            and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    build, said = CASES[case]
    argv = build(tmp_path)
    before = _md5s(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("sweep ", "usage:", "  "))]
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1 and "error:" in lines[0], err
    import re

    assert re.search(said, lines[0]), lines[0]
    after = _md5s(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing it found was changed
    if case.startswith("sweep over"):  # a refused sweep wrote nothing either (not even its experiment file)
        assert after.keys() == before.keys(), sorted(set(after) - set(before))
    os.chmod(tmp_path, 0o755)
    if (tmp_path / "results").is_dir():
        os.chmod(tmp_path / "results", 0o755)


def test_results_files_follow_the_umask(tmp_path):
    from harness import results as res

    old = os.umask(0o022)
    try:
        path = tmp_path / "r" / "x.jsonl"
        path.parent.mkdir()
        res.replace_rows(path, lambda r: False, [{"kind": "step", "status": "ok"}])
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.parametrize("body, said", [
    ('[experiment]\nname = "x"\nmodels = ["nope"]\nseq_lens = [64]\n', "unknown model 'nope'"),
    (TINY + "packing_cache = 1\n", "packing_cache] 1 is not a valid choice"),
    ("[experiment\n", "TOML"),
])
def test_a_bad_experiment_file_is_refused_without_importing_torch(tmp_path, body, said):
    """Checking the file imports no torch (seconds of start-up): with a torch that fails on
    import, the sweep still gives its one line."""
    import subprocess
    import sys

    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch was imported to check an experiment file')\n")
    exp = tmp_path / "bad.toml"
    exp.write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "harness", "sweep", str(exp), "--results", str(tmp_path / "r")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Interrupted mid-sweep: the rows written so far stay (each is written whole), and the user
    reads one line on how to resume, not a traceback."""
    from harness.run import sweep

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run", interrupted)
    exp = tmp_path / "tiny.toml"
    exp.write_text(TINY)
    assert main(["sweep", str(exp), "--results", str(tmp_path / "results"), "--quiet"]) == 130
    err = capsys.readouterr().err
    said = [line for line in err.strip().splitlines() if not line.startswith("sweep ")]  # its start line aside
    assert "Traceback" not in err and said == [
        "interrupted: the rows written so far are kept; run the same command again to resume"], err
