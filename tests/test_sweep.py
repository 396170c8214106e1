"""Sweeps: each point in its own process; a crash or OOM in one point becomes a row and the
sweep goes on; a rerun resumes; a sweep killed midway loses nothing already written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import results as res
from harness.measure import env as envmod
from harness.measure import host
from harness.measure.env import REPO_ROOT
from harness.row import Row
from harness.run import context, experiment, sweep

EXP = """
[experiment]
name = "iso"
models = ["llama-3.2-1b-tiny"]
seq_lens = [32]
device = "cpu"
dtype = "fp32"
lora_rank = 2
timeout_s = 120
bandwidth = false
[data]
median_doc_len = 8
[variants.good]
attn_implementation = "sdpa"
[variants.boom]
attn_implementation = "eager"
[variants.oom]
attn_implementation = "eager"
gradient_checkpointing = false
[variants.dies]
attn_implementation = "sdpa"
gradient_checkpointing = false
"""


LAUNCHERS = ["process", "preloaded"]


def _with(launcher: str, text: str = EXP) -> str:
    """The experiment text run by ``launcher`` (both give one process per point)."""
    return text.replace("bandwidth = false", f'bandwidth = false\nlauncher = "{launcher}"', 1)


def _rows(tmp_path):
    return res.read_rows(res.results_path(tmp_path / "results", "iso", "cpu"))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_failing_points_become_rows_and_sweep_goes_on(tmp_path, write_toml, monkeypatch, launcher):
    exp = experiment.load(write_toml(_with(launcher)))
    # One process per point: each faulty variant fails in its own way, the good one still runs.
    monkeypatch.setenv("PACKBENCH_FAULT", "boom=error,oom=oom,dies=crash")
    # the kernel's OOM killer ending another process of a busy host meanwhile would make "dies" a
    # host OOM (test_a_point_the_kernels_oom_killer_ends_is_a_host_oom_row): its count stays put here
    monkeypatch.setattr(host, "oom_kills", lambda *a: 7)
    summary = sweep.run(exp, tmp_path / "results", progress=False)
    rows = {r["variant"]: r for r in _rows(tmp_path)}
    assert summary.ran == 4 and summary.statuses == {"ok": 1, "error": 2, "oom": 1}
    assert rows["good"]["status"] == "ok" and rows["good"]["step_ms"]["p50"] > 0
    assert len(rows["good"]["loss"]) == 10 and len(rows["good"]["step_ms"]["samples"]) == 10
    assert rows["boom"]["status"] == "error" and "injected failure" in rows["boom"]["message"]
    assert "Traceback" in rows["boom"]["traceback"]
    assert rows["oom"]["status"] == "oom" and "out of memory" in rows["oom"]["message"]
    assert rows["dies"]["status"] == "error" and "SIGKILL" in rows["dies"]["message"]
    # the sweep's row for the dead point says which code measured it, as the point's own rows do:
    # a search that resumes on that code (harness.run.context) sees it
    assert {r["env"]["code_id"] for r in rows.values()} == {envmod.code_id()}
    if sys.platform.startswith("linux"):  # the host's memory in use, read beside every point
        assert all(0 < r["host_used_peak_gib"] <= r["env"]["host_memory_gib"] for r in rows.values())
    # A failure row, written by the point (boom, oom) or by the sweep for a dead one (dies), has
    # every field an ok row has but the measurements.
    header = set(Row.__dataclass_fields__) - {"measured"} | {"point_id"}
    for r in rows.values():
        assert header <= set(r), header - set(r)
        assert r["family"] == "llama" and r["num_layers"] == 2 and r["experiment_sha256"] == exp.sha256
    assert rows["good"]["switches_resolved"] == {}  # a stock variant enables no optim module

    # resume: the error and the crash are retried, the ok and the oom are not
    monkeypatch.delenv("PACKBENCH_FAULT")
    again = sweep.run(exp, tmp_path / "results", progress=False)
    assert again.skipped == 2 and again.ran == 2
    rows = {r["variant"]: r for r in _rows(tmp_path)}
    assert len(_rows(tmp_path)) == 4
    assert rows["boom"]["status"] == rows["dies"]["status"] == "ok" and rows["oom"]["status"] == "oom"


@pytest.mark.parametrize("oom_killer", [True, False])
def test_a_point_the_kernels_oom_killer_ends_is_a_host_oom_row(tmp_path, write_toml, monkeypatch, oom_killer):
    """A point killed by SIGKILL while the kernel's count of OOM kills went up ran the host out of
    memory: an oom row whose memory_bound is host, which bounds a context search as a GPU OOM does.
    A SIGKILL with the count unchanged is an error that says it was not the OOM killer."""
    kills = iter(range(1000))
    monkeypatch.setattr(host, "oom_kills", lambda *a: next(kills) if oom_killer else 7)
    exp = experiment.load(write_toml(_with("process", EXP.split("[variants.good]")[0] + "[variants.dies]\n")))
    monkeypatch.setenv("PACKBENCH_FAULT", "dies=crash")
    sweep.run(exp, tmp_path / "results", progress=False)
    (row,) = _rows(tmp_path)
    if oom_killer:
        assert (row["status"], row["memory_bound"]) == ("oom", "host")
        assert row["message"].startswith("out of host memory: the kernel's OOM killer ended the point")
        seen = context.outcomes(_rows(tmp_path), row["model"], "dies", envmod.code_id())
        assert seen == {32: "oom"} and "oom" in context.FAILS
        # unlike a GPU OOM, a rerun runs it again: what else the host held then counted
        monkeypatch.delenv("PACKBENCH_FAULT")
        again = sweep.run(exp, tmp_path / "results", progress=False)
        assert again.ran == 1 and [r["status"] for r in _rows(tmp_path)] == ["ok"]
    else:
        assert row["status"] == "error" and "memory_bound" not in row
        assert row["message"] == "killed by SIGKILL (not by the kernel's OOM killer)"


def test_a_code_change_measures_again_and_says_so(tmp_path, write_toml):
    """A comment appended to optim/loss.py, then the same sweep: the finished point runs again (its
    row's env.code_id is of other code), one line says why and names the flag, and the older row
    stays as that code's result; with --keep-older-rows the point counts as done."""
    import shutil

    repo = tmp_path / "repo"  # a copy of the measuring code, to change
    for pkg in ("optim", "harness"):
        shutil.copytree(REPO_ROOT / pkg, repo / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    path = write_toml(EXP.split("[variants.boom]")[0])
    results = tmp_path / "results"

    def sweep_again(*extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "harness", "sweep", str(path), "--results", str(results),
                               "--no-report", "--quiet", *extra], cwd=repo, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    assert "ran 1, skipped 0" in sweep_again()
    out = sweep_again()
    assert "ran 0, skipped 1" in out and "other code" not in out
    with open(repo / "optim" / "loss.py", "a") as f:
        f.write("# a comment\n")
    out = sweep_again()
    assert "ran 1, skipped 0" in out
    (line,) = [ln for ln in out.splitlines() if "again" in ln]
    assert line.startswith("measuring 1 finished point(s) again") and "--keep-older-rows" in line
    rows = res.read_rows(res.results_path(results, "iso", "cpu"))
    assert len(rows) == 2 and rows[0]["point_id"] == rows[1]["point_id"]
    assert rows[0]["env"]["code_id"] != rows[1]["env"]["code_id"]  # both kept, each its code's
    with open(repo / "optim" / "loss.py", "a") as f:
        f.write("# another\n")
    out = sweep_again("--keep-older-rows")
    assert "ran 0, skipped 1" in out and "keeping 1 finished point(s) measured by other code" in out


def test_overwrite_reruns_and_replaces(tmp_path, write_toml):
    exp = experiment.load(write_toml(EXP.split("[variants.boom]")[0]))
    sweep.run(exp, tmp_path / "results", progress=False)
    before = _rows(tmp_path)
    again = sweep.run(exp, tmp_path / "results", overwrite=True, progress=False)
    after = _rows(tmp_path)
    assert again.ran == 1 and len(after) == 1
    assert after[0]["point_id"] == before[0]["point_id"] and after[0]["step_ms"] != before[0]["step_ms"]


def test_a_rerun_that_fails_keeps_the_ok_row_it_would_have_replaced(tmp_path, write_toml, monkeypatch):
    """A rerun of the same code that ran out of memory (another process on the GPU) or crashed keeps
    the measurement it would have replaced: its failure row goes beside it, and the point stays done."""
    exp = experiment.load(write_toml(EXP.split("[variants.boom]")[0]))
    sweep.run(exp, tmp_path / "results", progress=False)
    (ok,) = _rows(tmp_path)
    for fault in ("oom", "error"):
        monkeypatch.setenv("PACKBENCH_FAULT", f"good={fault}")
        sweep.run(exp, tmp_path / "results", overwrite=True, progress=False)
        rows = _rows(tmp_path)
        assert [r["status"] for r in rows] == ["ok", fault] and rows[0]["step_ms"] == ok["step_ms"], rows
    monkeypatch.delenv("PACKBENCH_FAULT")
    assert sweep.run(exp, tmp_path / "results", progress=False).ran == 0  # the ok row still finishes it
    sweep.run(exp, tmp_path / "results", overwrite=True, progress=False)
    assert [r["status"] for r in _rows(tmp_path)] == ["ok"]  # an ok rerun replaces every row of its code


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_rows_say_where_a_points_time_went(tmp_path, write_toml, launcher):
    """``launched_s``: the sweep's age when it launched the point (its start-up, then the points
    before); ``setup_s``: the point's phases, ``wait`` first (imports, or the fork server's)."""
    exp = experiment.load(write_toml(_with(launcher, EXP.split("[variants.boom]")[0]) + """
[variants.c]
attn_implementation = "sdpa"
gradient_checkpointing = false
"""))
    t0 = time.perf_counter()
    sweep.run(exp, tmp_path / "results", progress=False)
    took = time.perf_counter() - t0
    first, second = _rows(tmp_path)
    assert 0 < first["launched_s"] < second["launched_s"]
    assert second["launched_s"] - first["launched_s"] >= first["wall_s"]  # the first ran in between
    for row in (first, second):
        phases = row["setup_s"]
        assert set(phases) == {"wait", "build", "enable", "warmup", "measured"}
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) - phases["wait"] <= row["wall_s"] + 0.05
        assert phases["measured"] > 0 and phases["wait"] < took
        # the first step's loss is in the row too: numerics are judged from the first step
        assert len(row["warmup_losses"]) == row["warmup_steps"] and all(x > 0 for x in row["warmup_losses"])
    if launcher == "process":  # each point imports torch itself; a fork of the server has it
        assert first["setup_s"]["wait"] > 0.5 and second["setup_s"]["wait"] > 0.5


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_timeout_kills_point(tmp_path, write_toml, monkeypatch, launcher):
    # A fresh process may still be importing torch after 2 s on a cold machine, and a stack dump
    # asked for in the middle of that import can crash the dump itself; 20 s is past its imports.
    limit = 2 if launcher == "preloaded" else 20
    text = _with(launcher, EXP.replace("timeout_s = 120", f"timeout_s = {limit}").split("[variants.boom]")[0])
    exp = experiment.load(write_toml(text))
    monkeypatch.setenv("PACKBENCH_FAULT", "good=hang")  # a preloaded point would finish inside 2 s
    s = sweep.run(exp, tmp_path / "results", progress=False)
    (row,) = _rows(tmp_path)
    assert s.ran == 1 and row["status"] == "error" and "timed out" in row["message"]
    # the log says where the point hung: the last progress it reported and its Python stacks,
    # which show the hang itself
    (log,) = (tmp_path / "results").rglob("*.log")
    text = log.read_text()
    assert f"timed out after {limit} s; last progress:" in text and 'File "' in text
    assert "in _inject_fault" in text


def test_periodic_stacks_show_where_a_slow_point_spent_its_time(tmp_path, write_toml, monkeypatch, capsys):
    from harness import cli

    text = _with("preloaded", EXP.replace("timeout_s = 120", "timeout_s = 3").split("[variants.boom]")[0])
    exp = experiment.load(write_toml(text))
    monkeypatch.setenv("PACKBENCH_FAULT", "good=hang")
    monkeypatch.setenv("PACKBENCH_STACKS_EVERY", "0.5")
    sweep.run(exp, tmp_path / "results", progress=False)
    (log,) = (tmp_path / "results").rglob("*.log")
    assert log.read_text().count("in _inject_fault") >= 3  # every 0.5 s, then once more at the kill
    monkeypatch.setenv("PACKBENCH_STACKS_EVERY", "soon")
    assert cli.main(["sweep", str(write_toml(text)), "--results", str(tmp_path / "r2"), "--no-report"]) == 2
    assert "PACKBENCH_STACKS_EVERY='soon': give a number of seconds" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()  # refused before any point ran


def test_group_sigterm_still_gets_the_stacks_of_the_point_in_flight(tmp_path, write_toml):
    # what `timeout`, a CI runner or a scheduler does: SIGTERM to the sweep's whole process group,
    # the preloaded launcher's fork server included, whose death would kill the point at once
    # (on the H100 a sweep stopped by `timeout` logged "no stacks" for its point in flight)
    path = write_toml(_with("preloaded", EXP.split("[variants.boom]")[0]))
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "harness", "sweep", str(path), "--results", str(results), "--no-report", "--quiet"]
    env = {**os.environ, "PACKBENCH_FAULT": "good=hang", "PACKBENCH_STACKS_EVERY": "5"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    logs = []
    while time.time() < deadline and not (logs and "in _inject_fault" in logs[0].read_text()):
        time.sleep(0.2)
        logs = list(results.rglob("*.log"))
    assert logs and "in _inject_fault" in logs[0].read_text(), "the point never reached its hang"
    # the group's signal as the kernel may deliver it: the fork server first, the sweep after
    for pid in _children(proc.pid):
        if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # soon after a periodic dump: the next is 5 s away
    assert proc.wait(timeout=60) != 0
    text = logs[0].read_text()
    assert "the sweep is stopping; last progress:" in text
    # the stacks it was asked for came whole: the point lived until the sweep had them
    last = text.split("the sweep is stopping")[-1]
    assert "in _inject_fault" in last and "in main" in last  # to its bottom frames


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_killed_midway_then_resumed(tmp_path, write_toml, launcher):
    path = write_toml(_with(launcher, EXP.split("[variants.boom]")[0]) + """
[variants.b]
attn_implementation = "eager"
[variants.c]
attn_implementation = "sdpa"
gradient_checkpointing = false
""")
    results = tmp_path / "results"
    out = res.results_path(results, "iso", "cpu")
    cmd = [sys.executable, "-m", "harness", "sweep", str(path), "--results", str(results), "--no-report", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and len(res.read_rows(out)) >= 1):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the point in flight
    proc.wait()
    written = res.read_rows(out)  # still a valid file
    assert 1 <= len(written) < 3
    first_ids = {r["point_id"] for r in written}

    exp = experiment.load(path)
    summary = sweep.run(exp, results, progress=False)
    assert summary.skipped == len(written)
    rows = res.read_rows(out)
    assert len(rows) == 3 and len({r["point_id"] for r in rows}) == 3
    assert first_ids <= {r["point_id"] for r in rows}
    assert all(r["status"] == "ok" for r in rows)


def _children(pid):
    try:
        return [int(k) for k in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _descendants(pid):
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _point_of(pid, deadline):
    """The point process: the sweep's child (process launcher) or its fork server's child."""
    while time.time() < deadline:
        for p in _descendants(pid):
            try:
                if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[3] == str(p):
                    return p  # its own process group: the point, which calls setsid
            except OSError:
                pass
        time.sleep(0.1)
    raise AssertionError("the sweep started no point process")


def _gone(pid, deadline):
    while time.time() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_point_dies_with_its_sweep(tmp_path, write_toml, how, launcher):
    """A sweep stopped by a signal to its own process (timeout, CI cancel, OOM killer) must not
    leave its point running: a point in its own session would keep holding the GPU."""
    path = write_toml(_with(launcher, EXP.split("[variants.boom]")[0]))
    cmd = [sys.executable, "-m", "harness", "sweep", str(path), "--results", str(tmp_path / "r"),
           "--no-report", "--quiet"]
    env = dict(os.environ, PACKBENCH_FAULT="good=hang")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        child = _point_of(proc.pid, time.time() + 60)
        time.sleep(1.0)  # past the child's start-up
        os.kill(proc.pid, how)  # the sweep alone, not its group
        proc.wait(timeout=30)
        assert _gone(child, time.time() + 30), "the point outlived its sweep"
    finally:
        proc.kill()


def test_corrupt_results_stop_the_sweep_before_it_runs(tmp_path, write_toml):
    exp = experiment.load(write_toml(EXP))
    out = res.results_path(tmp_path / "results", "iso", "cpu")
    out.parent.mkdir(parents=True)
    out.write_text("{broken\n")
    with pytest.raises(ValueError, match="not a whole result row"):
        sweep.run(exp, tmp_path / "results", progress=False)
    assert out.read_text() == "{broken\n"


def test_chunked_loss_point(tmp_path, write_toml):
    exp = experiment.load(write_toml(EXP.split("[variants.boom]")[0].replace(
        'bandwidth = false', 'bandwidth = false\nloss = "chunked"')))
    sweep.run(exp, tmp_path / "results", progress=False)
    (row,) = _rows(tmp_path)
    assert row["status"] == "ok", row.get("message")
    assert row["loss_mode"] == "chunked" and all(x > 0 for x in row["loss"])
    assert row["cuda_graph"] is False and row["peak_scope"] == "measured steps"


def test_cli_overrides_launcher_and_timeout_keeping_point_ids(tmp_path, write_toml, monkeypatch, capsys):
    from harness import cli

    path = write_toml(_with("process", EXP.split("[variants.boom]")[0]))
    (point,) = experiment.load(path).points()
    monkeypatch.setenv("PACKBENCH_FAULT", "good=hang")
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["sweep", str(path), "--results", str(tmp_path / "results"), "--no-report",
                         "--quiet", "--launcher", "preloaded", "--timeout", "2"])
    finally:
        signal.signal(signal.SIGTERM, before)
    (row,) = _rows(tmp_path)
    assert code == 0 and row["point_id"] == point.point_id
    # provenance: the command line, and the experiment file kept under results/ by its hash
    assert row["command"] == (f"python -m harness sweep {path} --results {tmp_path / 'results'} --no-report "
                              "--quiet --launcher preloaded --timeout 2")
    kept = tmp_path / "results" / "iso" / "experiments" / f"{row['experiment_sha256'][:16]}.toml"
    assert kept.read_text() == Path(path).read_text()
    assert row["status"] == "error" and row["message"] == "timed out after 2 s"
    with pytest.raises(SystemExit):
        cli.main(["sweep", str(path), "--timeout", "0"])
    assert "positive number of seconds" in capsys.readouterr().err


def test_a_graphed_variant_on_a_machine_without_cuda_is_an_error_row(tmp_path, write_toml):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_gpu_graphs.py covers the graphed point")
    exp = experiment.load(write_toml(EXP.split("[variants.boom]")[0].replace(
        'attn_implementation = "sdpa"', 'attn_implementation = "sdpa"\ncuda_graph = true', 1)
        .replace('device = "cpu"', 'device = "auto"')))
    sweep.run(exp, tmp_path / "results", progress=False)
    (row,) = _rows(tmp_path)
    assert row["status"] == "error" and "cuda_graph = true, which needs a CUDA device" in row["message"]


def test_rows_count_the_graphs_compiled_before_and_in_each_measured_step(tmp_path, write_toml):
    """A compiled point compiles in its warm-up; an eager one never; each measured step's count is
    recorded, so a median that includes a compile can be told from the steady state."""
    exp = experiment.load(write_toml(EXP.split("[variants.good]")[0].replace(
        'seq_lens = [32]', 'seq_lens = [64]\nwarmup_steps = 3\nmeasured_steps = 10') + """
[variants.eager]
attn_implementation = "sdpa"
[variants.compiled]
attn_implementation = "sdpa"
compile_layers = true
"""))
    sweep.run(exp, tmp_path / "results", progress=False)
    rows = {r["variant"]: r for r in _rows(tmp_path)}
    assert rows["eager"]["status"] == rows["compiled"]["status"] == "ok"
    assert rows["eager"]["compiled_graphs_warmup"] == 0 and rows["eager"]["compiled_graphs_per_step"] == [0] * 10
    assert rows["compiled"]["compiled_graphs_warmup"] > 0
    assert len(rows["compiled"]["compiled_graphs_per_step"]) == 10


def test_the_eta_adds_up_recorded_wall_times_then_this_runs_own(monkeypatch):
    """Recorded wall times first (steady from the first point on), this run's mean for points
    never run; a point under way counts what it has left of its own."""
    import io

    from harness.run import sweep as sw

    clock = {"t": 1000.0}
    monkeypatch.setattr(sw.time, "monotonic", lambda: clock["t"])
    bar = sw.Progress(4, stream=io.StringIO(), expected_s=[100.0, None, 50.0, None])
    assert bar.eta_s() == pytest.approx(100 + 75 + 50 + 75)  # an unknown point: the recorded ones' mean
    bar.start(1, "a")
    clock["t"] += 40
    assert bar.eta_s() == pytest.approx(60 + 75 + 50 + 75)
    bar.finish("ok", {})
    assert bar.took == [40.0]
    assert bar.eta_s() == pytest.approx(40 + 50 + 40)  # the unknown ones now count this run's 40 s
    bar.start(2, "b")
    clock["t"] += 100  # over its guess: nothing left of its own, never negative
    assert bar.eta_s() == pytest.approx(50 + 40)
    assert sw.Progress(2, stream=io.StringIO()).eta_s() is None


def test_the_fork_server_leaves_peft_to_the_points_where_bitsandbytes_is_installed():
    """peft imports bitsandbytes, which reads the GPU at import: CUDA initialized in the fork server
    would leave every forked point unable to use it."""
    from harness.run import server

    assert "peft" in server.preload_modules(find_spec=lambda name: None)
    found = server.preload_modules(find_spec=lambda name: object() if name == "bitsandbytes" else None)
    assert "peft" not in found and found[:2] == ["harness.run.server", "torch"]


def test_a_forked_point_whose_server_initialized_cuda_runs_as_a_fresh_process(tmp_path, write_toml):
    """Where an import in the fork server initialized CUDA anyway, the forked point cannot use it: it
    replaces itself with a fresh interpreter that runs the point and writes its row, one line said."""
    from harness.run import launchers

    (point,) = experiment.load(write_toml(EXP.split("[variants.boom]")[0])).points()
    spec, out = tmp_path / "point.json", tmp_path / "row.json"
    spec.write_text(point.to_json())
    # the fork's view of a server that initialized CUDA; the fresh interpreter has its own torch
    code = ("import sys, torch; torch.cuda._is_in_bad_fork = lambda: True\n"
            "from harness.run import launchers\n"
            f"sys.exit(launchers.run_forked_point({str(spec)!r}, {str(out)!r}))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert launchers.FRESH_NOTE in done.stderr
    row = json.loads(out.read_text())
    assert row["status"] == "ok" and row["variant"] == "good" and row["step_ms"]["p50"] > 0


def test_the_collector_is_kept_out_of_measured_steps_unless_the_file_says_as_run(tmp_path, write_toml):
    """The harness's protocol freezes and disables the cycle collector for the measured steps;
    ``collector = "as_run"`` leaves it as the stack left it, a point of its own, its collections
    counted in the row; the report's methodology says which."""
    from harness.report import sections

    base = EXP.split("[variants.good]")[0].replace('seq_lens = [32]', 'seq_lens = [64]\nwarmup_steps = 3\nmeasured_steps = 10')
    body = '[variants.good]\nattn_implementation = "sdpa"\n'
    rows = {}
    for mode in ("frozen", "as_run"):
        text = base.replace("bandwidth = false", f'bandwidth = false\ncollector = "{mode}"', 1) + body
        sweep.run(experiment.load(write_toml(text, f"{mode}.toml")), tmp_path / mode, progress=False)
        (rows[mode],) = res.read_rows(res.results_path(tmp_path / mode, "iso", "cpu"))
    frozen, as_run = rows["frozen"], rows["as_run"]
    assert frozen["status"] == as_run["status"] == "ok"
    assert frozen["collector"] == "" and as_run["collector"] == "as_run"
    assert frozen["point_id"] != as_run["point_id"]
    assert frozen["gc_collections"] == [0, 0, 0]
    assert as_run["gc_collections"][0] > 0  # a stock step allocates past CPython's young threshold
    assert "frozen and disabled" in sections._collector_sentence([frozen])
    assert "as each stack leaves it" in sections._collector_sentence([as_run])
    assert "in 1 of 2 step rows" in sections._collector_sentence([frozen, as_run])
    with pytest.raises(experiment.ExperimentError, match="experiment.collector"):
        experiment.load(write_toml(base.replace("bandwidth = false", 'bandwidth = false\ncollector = "off"', 1) + body,
                                   "bad.toml"))


def test_a_point_that_fails_in_a_measured_step_gives_the_collector_back(write_toml, monkeypatch):
    """A step that raises after the collector was frozen and disabled: the row says error, and the
    process's collector is enabled and unfrozen again (the preloaded launcher's process lives on)."""
    import gc

    from harness.run import point as point_mod

    base = EXP.split("[variants.good]")[0].replace('seq_lens = [32]', 'seq_lens = [64]\nwarmup_steps = 3\nmeasured_steps = 10')
    (p,) = experiment.load(write_toml(base + '[variants.good]\nattn_implementation = "sdpa"\n')).points()
    step = point_mod.Prepared.step

    def failing(self, point, i, *args, **kwargs):
        if i == point.warmup_steps + 1:
            assert not gc.isenabled() and gc.get_freeze_count() > 0  # inside the measured region
            raise RuntimeError("a failing measured step")
        return step(self, point, i, *args, **kwargs)

    monkeypatch.setattr(point_mod.Prepared, "step", failing)
    assert gc.isenabled()
    row = point_mod.run_point(p)
    assert row["status"] == "error" and "a failing measured step" in row["message"]
    assert gc.isenabled() and gc.get_freeze_count() == 0
