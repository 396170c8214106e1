"""A sweep spread by Ray (``--cluster ray``), on a local Ray with two CPUs: rows come back and are
appended as tasks end, an OOM is a row, a task whose worker dies is an error row and the sweep goes
on, and a rerun submits only what is unfinished."""

from __future__ import annotations

import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")  # the project's test extra installs it; CI runs these

from harness import results as res  # noqa: E402
from harness.measure.env import REPO_ROOT  # noqa: E402
from harness.run import cluster, experiment  # noqa: E402

EXP = """
[experiment]
name = "rayx"
models = ["qwen3-0.6b-tiny"]
seq_lens = [32]
device = "cpu"
dtype = "fp32"
lora_rank = 2
bandwidth = false
timeout_s = 120
[data]
median_doc_len = 8
[variants.good]
attn_implementation = "sdpa"
[variants.oom]
attn_implementation = "eager"
[variants.lost]
attn_implementation = "sdpa"
gradient_checkpointing = false
"""


@pytest.fixture(scope="module")
def local_ray():
    cluster.connect(num_cpus=2)
    yield
    ray.shutdown()


def test_points_run_as_ray_tasks_rows_come_back_and_a_rerun_resumes(local_ray, tmp_path, write_toml, monkeypatch):
    monkeypatch.setenv("PACKBENCH_FAULT", "oom=oom")  # travels to the task with its point
    monkeypatch.setenv(cluster.TASK_FAULT_ENV, "lost")  # that point's Ray worker dies
    exp = experiment.load(write_toml(EXP))
    summary = cluster.run(exp, tmp_path / "results", progress=False, command="test")
    assert summary.ran == 3 and summary.statuses == {"ok": 1, "oom": 1, "error": 1}
    path = res.results_path(tmp_path / "results", "rayx", "cpu")
    rows = {r["variant"]: r for r in res.read_rows(path)}  # the lost point's row too, in the same file
    assert rows["good"]["status"] == "ok" and len(rows["good"]["step_ms"]["samples"]) == 10
    assert rows["good"]["node"] and rows["good"]["command"] == "test"
    assert rows["oom"]["status"] == "oom" and "injected" in rows["oom"]["message"]
    assert rows["lost"]["status"] == "error" and rows["lost"]["message"].startswith("ray: ")
    assert {p.point_id for p in exp.points()} == {r["point_id"] for r in rows.values()}
    logs = tmp_path / "results" / "rayx" / "logs" / "cpu"
    assert (logs / f"{rows['good']['point_id']}.log").exists()

    monkeypatch.delenv(cluster.TASK_FAULT_ENV)
    again = cluster.run(exp, tmp_path / "results", progress=False)
    assert (again.skipped, again.ran, again.statuses) == (2, 1, {"ok": 1})  # only the error point ran
    rows = {r["variant"]: r for r in res.read_rows(path)}
    assert len(rows) == 3 and rows["lost"]["status"] == "ok"


def test_the_same_points_as_a_local_sweep(local_ray, tmp_path, write_toml):
    exp = experiment.load(write_toml(EXP))
    cluster.run(exp, tmp_path / "results", progress=False)
    rows = res.read_rows(res.results_path(tmp_path / "results", "rayx", "cpu"))
    assert sorted(r["point_id"] for r in rows) == sorted(p.point_id for p in exp.points())
    assert all(r["status"] == "ok" for r in rows)


def test_cli_refuses_bad_resources_before_anything_runs(tmp_path, write_toml):
    path = write_toml(EXP)
    proc = subprocess.run([sys.executable, "-m", "harness", "sweep", str(path), "--cluster", "ray",
                           "--ray-resources", "one_per_host", "--results", str(tmp_path / "r")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give NAME=N" in proc.stderr
    assert not (tmp_path / "r").exists()
