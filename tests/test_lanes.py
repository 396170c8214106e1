"""sweep --devices: one host's GPUs as lanes, checked on CPU, where a lane's device name is only
the CUDA_VISIBLE_DEVICES its children get. Each model at each length runs its variants in one
lane, every point once, the lanes at the same time; bad lanes are refused before anything runs;
a stopped sweep stops its children, which keep their points' stopped rows, and the same command
resumes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import results as res
from harness.run import experiment, lanes

ROOT = Path(__file__).resolve().parents[1]
EXP = """
[experiment]
name = "lanes"
models = ["qwen3-0.6b-tiny", "llama-3.2-1b-tiny"]
seq_lens = [64, 96]
device = "cpu"
dtype = "fp32"
lora_rank = 2
warmup_steps = 3
measured_steps = 10
timeout_s = 120
[data]
median_doc_len = 16
[variants.stock]
role = "stock"
attn_implementation = "sdpa"
[variants.ours]
packing_backend = "sdpa"
"""


def _sweep(path: Path, results: Path, *extra: str, cpu_lanes: bool = True, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu_lanes:  # the lanes' names are only names here: CUDA_VISIBLE_DEVICES of a CPU point
        env[lanes.CPU_ENV] = "1"
    return subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(path), "--results", str(results),
                             "--no-report", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def _finish(proc, timeout: float) -> str:
    """The sweep's output once it exits; past ``timeout`` it is killed with its lanes, then fails."""
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_each_model_and_length_runs_its_variants_in_one_lane_and_every_point_once(tmp_path, write_toml):
    path = write_toml(EXP)
    proc = _sweep(path, tmp_path / "r", "--devices", "a", "b")
    out = _finish(proc, 900)
    assert proc.returncode == 0, out[-3000:]
    rows = [r for r in res.read_rows(res.results_path(tmp_path / "r", "lanes", "cpu")) if r["kind"] == "step"]
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}, [(r["variant"], r.get("message")) for r in rows]
    assert len({r["point_id"] for r in rows}) == 8
    by_group = {}
    for r in rows:
        by_group.setdefault((r["model"], r["seq_len"]), set()).add(r["lane"])
    assert all(len(v) == 1 for v in by_group.values()), by_group  # a group's roles: one lane
    assert {lane for v in by_group.values() for lane in v} == {"a", "b"}  # both lanes ran
    assert "4 groups over 2 lanes; failed: none" in out
    assert {r["command"] for r in rows} == {f"python -m harness sweep {path} --results {tmp_path / 'r'} --no-report "
                                            "--devices a b"}  # the command that started the lanes
    from harness.report import fmt

    assert fmt.command(rows[0]["command"]) == f"python -m harness sweep {path}"
    # resumed: no group has a point left, none starts, and no row is added
    again = _sweep(path, tmp_path / "r", "--devices", "a", "b")
    out = _finish(again, 300)
    assert again.returncode == 0 and "0 groups over 2 lanes" in out, out[-3000:]
    assert len([r for r in res.read_rows(res.results_path(tmp_path / "r", "lanes", "cpu")) if r["kind"] == "step"]) == 8


def test_groups_go_longest_first_to_the_least_loaded_lane(write_toml):
    points = experiment.load(write_toml(EXP)).points()
    walls = {p.point_id: {("qwen3-0.6b-tiny", 96): 50.0, ("llama-3.2-1b-tiny", 96): 40.0}.get((p.model, p.seq_len), 10.0)
             for p in points}
    layout = lanes.plan(points, ["0", "1"], walls)
    assert layout == [[("qwen3-0.6b-tiny", 96), ("llama-3.2-1b-tiny", 64)],
                      [("llama-3.2-1b-tiny", 96), ("qwen3-0.6b-tiny", 64)]]
    # never run: one second a point, the file's order
    assert lanes.plan(points, ["0", "1", "2", "3"], {}) == [[g] for g in lanes.groups(points)]
    # a finished group has no points left and no lane
    left = [p for p in points if p.model == "qwen3-0.6b-tiny"]
    assert lanes.plan(left, ["0", "1"], {}) == [[("qwen3-0.6b-tiny", 64)], [("qwen3-0.6b-tiny", 96)]]


@pytest.mark.parametrize("devices, edit, cpu_lanes, says", [
    (["0", "0"], None, True, "each GPU in one lane"),
    (["0,1", "1"], None, True, "each GPU in one lane"),
    (["0", "1"], 'gpus = [2]\nparallel = "fsdp2"', True, "take 2 GPUs, and lane"),
    (["0", "1"], "pin_cpu = true", True, "the same core in every lane"),
    (["0", "1"], None, False, "runs on the CPU here"),
])
def test_lanes_that_cannot_run_the_file_are_refused_before_anything_runs(tmp_path, write_toml, devices, edit,
                                                                          cpu_lanes, says):
    text = EXP if edit is None else EXP.replace('dtype = "fp32"', f'dtype = "fp32"\n{edit}')
    proc = _sweep(write_toml(text), tmp_path / "r", "--devices", *devices, cpu_lanes=cpu_lanes)
    out = _finish(proc, 300)
    assert proc.returncode == 2 and says in out, out[-2000:]
    assert not res.results_path(tmp_path / "r", "lanes", "cpu").exists()


@pytest.mark.slow
def test_a_stopped_sweep_stops_every_lane_and_the_same_command_resumes(tmp_path, write_toml):
    path = write_toml(EXP.replace("measured_steps = 10", "measured_steps = 150"))
    proc = _sweep(path, tmp_path / "r", "--devices", "a", "b")
    results = res.results_path(tmp_path / "r", "lanes", "cpu")
    logs = tmp_path / "r" / "lanes" / "logs" / "lanes"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sum("points from" in f.read_text() for f in logs.glob("*.log")) < 2:
        time.sleep(0.5)  # each lane's child has read the file and starts its first point
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, 180)
    assert proc.returncode != 0
    stopped = [r for r in res.read_rows(results) if r["kind"] == "stopped"]
    assert len(stopped) == 2, out[-3000:]  # one point in flight per lane, each kept as stopped
    assert not _alive(str(tmp_path)), "a lane's sweep outlived the stop"
    # the same command resumes: the stopped points run again, and every point finishes once
    again = _sweep(path, tmp_path / "r", "--devices", "a", "b")
    out = _finish(again, 900)
    assert again.returncode == 0, out[-3000:]
    steps = [r for r in res.read_rows(results) if r["kind"] == "step"]
    assert len(steps) == len({r["point_id"] for r in steps}) == 8 and {r["status"] for r in steps} == {"ok"}
    assert {r["point_id"] for r in stopped} <= {r["point_id"] for r in steps}


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (a child sweep names its results root)."""
    time.sleep(1)
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    alive.append(int(d.name))
            except OSError:
                continue
    return alive


def test_a_child_sweep_is_asked_for_what_the_parent_was():
    args = SimpleNamespace(results=Path("r"), overwrite=True, keep_older_rows=False, launcher="process", timeout=None)
    argv = lanes.child_argv(Path("e.toml"), ("m", 64), ["a", "b"], args, 30.5)
    assert argv[1:] == ["-m", "harness", "sweep", "e.toml", "--models", "m", "--seq-lens", "64", "--variants", "a", "b",
                        "--results", "r", "--no-report", "--quiet", "--overwrite", "--launcher", "process",
                        "--stop-after", "30.5"]
    args = SimpleNamespace(results=Path("r"), overwrite=False, keep_older_rows=True, launcher=None, timeout=90.0)
    assert lanes.child_argv(Path("e.toml"), ("m", 64), ["a"], args, None)[15:] == ["--keep-older-rows", "--timeout",
                                                                                   "90.0"]
