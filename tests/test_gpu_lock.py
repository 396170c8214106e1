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
from test_sweep import EXP as SWEEP_EXP

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


def _holds_at_once(uuids: list[str], who: str, then=lambda: None) -> None:
    """Take ``uuids`` while another process holds GPU-aaaa for 30 s (``then`` runs once it holds it):
    with no wait and nothing said."""
    first = _holder("GPU-aaaa", 30.0)
    try:
        then()
        out = io.StringIO()
        began = time.monotonic()
        with gpu_lock.hold(uuids, who, stream=out):
            assert time.monotonic() - began < 5.0 and out.getvalue() == ""
    finally:
        first.kill()
        first.wait()


def test_other_gpus_do_not_wait(lock_dir):
    _holds_at_once(["GPU-bbbb"], "another card")


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
    # switched off in this process only, once the holder (locking as usual) has the GPU
    _holds_at_once(["GPU-aaaa"], "shared on purpose", then=lambda: monkeypatch.setenv("PACKBENCH_GPU_LOCK", "0"))


SWEEP = textwrap.dedent("""
    import json, sys, time
    from harness.run import experiment, gpu_lock, sweep
    sweep.detect_device_name = lambda requested: "NVIDIA Fake GPU"  # the points still run on the CPU
    gpu_lock.visible_gpus = lambda count: ["GPU-fake-0"]
    if sys.argv[3] == "sweep A":  # it holds the GPU a while before its point: B surely finds it taken
        real = sweep._run
        sweep._run = lambda *a, **k: (time.sleep(5), real(*a, **k))[1]
    s = sweep.run(experiment.load(sys.argv[1]), sys.argv[2], progress=False, command=sys.argv[3])
    print(json.dumps({"ran": s.ran, "skipped": s.skipped}))
""")

EXP = SWEEP_EXP.split("[variants.boom]")[0]  # one tiny CPU point


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


def test_a_sweep_whose_time_runs_out_waiting_starts_nothing_and_leaves_its_points(lock_dir, tmp_path, write_toml,
                                                                                   monkeypatch, capsys):
    from harness.run import experiment, sweep

    monkeypatch.setattr(sweep, "detect_device_name", lambda requested: "NVIDIA Fake GPU")
    monkeypatch.setattr(gpu_lock, "visible_gpus", lambda count: ["GPU-fake-0"])
    first = _holder("GPU-fake-0", 60.0)
    try:
        began = time.monotonic()
        summary = sweep.run(experiment.load(write_toml(EXP)), tmp_path / "results", progress=False, stop_after_s=1.5)
        assert time.monotonic() - began < 10
    finally:
        first.kill()
        first.wait()
    assert (summary.ran, summary.left) == (0, 1)
    assert "stayed in use by pid" in capsys.readouterr().err


def test_the_wait_has_a_limit(lock_dir):
    first = _holder("GPU-aaaa", 60.0)
    try:
        with pytest.raises(gpu_lock.Busy, match="GPU-aaaa stayed in use by pid"):
            with gpu_lock.hold(["GPU-aaaa"], "in a hurry", stream=io.StringIO(), timeout_s=1.0):
                pass
    finally:
        first.kill()
        first.wait()


def test_every_user_can_open_the_lock_file_whatever_the_umask(lock_dir):
    old = os.umask(0o077)
    try:
        with gpu_lock.hold(["GPU-aaaa"], "umask 077"):
            pass
    finally:
        os.umask(old)
    assert (lock_dir / "GPU-aaaa.lock").stat().st_mode & 0o777 == 0o666


def test_a_planted_link_is_never_written(lock_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    lock_dir.mkdir()
    (lock_dir / "GPU-aaaa.lock").symlink_to(victim)
    with pytest.raises(gpu_lock.LockError, match="symbolic link"):
        with gpu_lock.hold(["GPU-aaaa"], "planted"):
            pass
    os.link(victim, lock_dir / "GPU-bbbb.lock")  # a second name for the file: locked, not written
    with gpu_lock.hold(["GPU-bbbb"], "hard link"):
        pass
    assert victim.read_text() == "keep me\n"


def test_a_lock_folder_that_cannot_be_made_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PACKBENCH_LOCK_DIR", str(tmp_path / "a-file" / "locks"))
    with pytest.raises(gpu_lock.LockError, match="PACKBENCH_LOCK_DIR"):
        with gpu_lock.hold(["GPU-aaaa"], "nowhere"):
            pass


class _FakeNVML:
    """pynvml with four GPUs on the host: GPU-aaaa-0 ... GPU-dddd-3."""

    class NVMLError(Exception):
        pass

    UUIDS = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2", "GPU-dddd-3"]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.UUIDS[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        raise self.NVMLError(uuid)

    def nvmlDeviceGetUUID(self, handle):
        return handle.encode()


@pytest.mark.parametrize("visible, count, expected", [
    (None, 2, ["GPU-aaaa-0", "GPU-bbbb-1"]),
    ("2", 1, ["GPU-cccc-2"]),
    ("2", 2, ["GPU-cccc-2"]),  # one visible: never NVML's own GPU 1 beside it
    ("3,1", 2, ["GPU-dddd-3", "GPU-bbbb-1"]),
    ("GPU-cccc", 1, ["GPU-cccc-2"]),  # a unique start of a UUID, as CUDA takes it
    ("bbbb-1", 1, ["GPU-bbbb-1"]),  # without its prefix
    ("7,0", 2, []),  # CUDA stops at the first entry it cannot resolve
    ("GPU-", 1, []),  # not unique
])
def test_the_gpus_locked_are_the_ones_cuda_shows(monkeypatch, visible, count, expected):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML())
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_lock.visible_gpus(count) == expected
