"""One sweep at a time on a GPU (harness/run/gpu_lock.py): a second sweep on the same card waits,
says whose sweep it waits for, and then reads the first one's rows before it decides what is
left; a killed holder leaves no lock behind. Run on CPU with made-up GPU UUIDs and real processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness.measure.env import REPO_ROOT
from harness.run import gpu_lock

HOLD = textwrap.dedent("""
    import sys, time
    from harness.run import gpu_lock
    with gpu_lock.hold([sys.argv[1]], "the first sweep"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKBENCH_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("PACKBENCH_GPU_LOCK", raising=False)
    return tmp_path / "locks"


def _holder(uuid: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, uuid, str(seconds)], cwd=REPO_ROOT, env=dict(os.environ),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_waits_for_the_first_and_names_it(lock_dir):
    first = _holder("GPU-aaaa", 2.0)
    out = io.StringIO()
    began = time.monotonic()
    with gpu_lock.hold(["GPU-aaaa"], "the second sweep", stream=out):
        waited = time.monotonic() - began
    first.wait()
    assert waited > 1.0, waited  # the first held it for 2 s after saying so
    said = out.getvalue()
    assert f"GPU GPU-aaaa is in use by pid {first.pid} (the first sweep)" in said and "free after" in said


def test_other_gpus_do_not_wait(lock_dir):
    first = _holder("GPU-aaaa", 30.0)
    try:
        out = io.StringIO()
        began = time.monotonic()
        with gpu_lock.hold(["GPU-bbbb"], "another card", stream=out):
            assert time.monotonic() - began < 5.0 and out.getvalue() == ""
    finally:
        first.kill()
        first.wait()


def test_a_killed_holder_leaves_no_lock(lock_dir):
    first = _holder("GPU-aaaa", 600.0)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    out = io.StringIO()
    with gpu_lock.hold(["GPU-aaaa"], "after a kill", stream=out):
        assert out.getvalue() == ""


def test_the_same_process_holds_a_gpu_again_at_once(lock_dir):
    code = textwrap.dedent("""
        from harness.run import gpu_lock
        with gpu_lock.hold(["GPU-aaaa"], "outer"):
            with gpu_lock.hold(["GPU-aaaa", "GPU-bbbb"], "inner"):
                pass
            with gpu_lock.hold(["GPU-aaaa"], "inner again"):
                pass
        print("done")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "done", out.stderr


def test_the_switch_turns_the_locks_off(lock_dir, monkeypatch):
    first = _holder("GPU-aaaa", 30.0)
    try:
        monkeypatch.setenv("PACKBENCH_GPU_LOCK", "0")
        out = io.StringIO()
        began = time.monotonic()
        with gpu_lock.hold(["GPU-aaaa"], "shared on purpose", stream=out):
            assert time.monotonic() - began < 5.0 and out.getvalue() == ""
    finally:
        first.kill()
        first.wait()


SWEEP = textwrap.dedent("""
    import json, sys
    from harness.run import experiment, gpu_lock, sweep
    sweep.detect_device_name = lambda requested: "NVIDIA Fake GPU"  # the points still run on the CPU
    gpu_lock.visible_gpus = lambda count: ["GPU-fake-0"]
    s = sweep.run(experiment.load(sys.argv[1]), sys.argv[2], progress=False, command=sys.argv[3])
    print(json.dumps({"ran": s.ran, "skipped": s.skipped}))
""")

EXP = """
[experiment]
name = "locked"
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
"""


def test_a_second_sweep_on_the_gpu_waits_then_finds_the_point_done(lock_dir, tmp_path, write_toml):
    path, results = write_toml(EXP), tmp_path / "results"
    argv = [sys.executable, "-c", SWEEP, str(path), str(results)]
    first = subprocess.Popen([*argv, "sweep A"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    lock = lock_dir / "GPU-fake-0.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and f"pid {first.pid}" in lock.read_text()):
        assert time.monotonic() < deadline and first.poll() is None, "the first sweep never took its GPU"
        time.sleep(0.05)
    second = subprocess.run([*argv, "sweep B"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    a = json.loads(first.communicate(timeout=300)[0].strip().splitlines()[-1])
    b = json.loads(second.stdout.strip().splitlines()[-1])
    assert f"in use by pid {first.pid} (sweep A)" in second.stderr, second.stderr
    assert a == {"ran": 1, "skipped": 0}
    assert b == {"ran": 0, "skipped": 1}  # it read the first sweep's row after the wait, not before
