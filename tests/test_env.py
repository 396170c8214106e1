"""What every row records about where and what ran."""

from __future__ import annotations


import pytest


@pytest.fixture
def env_of_a_tree(tmp_path, monkeypatch):
    """harness.measure.env reading a tree of its own: optim/a.py and harness/a.py, ``x = 1``."""
    from harness.measure import env

    monkeypatch.setattr(env, "REPO_ROOT", tmp_path)
    for pkg in ("optim", "harness"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    return env


def test_code_sha_tracks_the_measuring_code_only(tmp_path, env_of_a_tree):
    env = env_of_a_tree
    first = env.code_sha()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.py").write_text("y = 2\n")  # not measuring code
    assert env.code_sha() == first
    (tmp_path / "optim" / "a.py").write_text("x = 2\n")
    assert env.code_sha() != first


def test_a_sweeps_own_rows_do_not_make_the_tree_dirty(tmp_path, monkeypatch, env_of_a_tree):
    """Every row after a sweep's first once read dirty: the sweep had appended to a tracked
    results file. Changes to results/ and reports/ are what it measures, not what it runs."""
    import subprocess

    env = env_of_a_tree
    monkeypatch.delenv("PACKBENCH_GIT_SHA", raising=False)
    for d in ("results", "reports"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f.jsonl").write_text("{}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    assert env.git_state()["git_dirty"] is False
    for d in ("results", "reports"):
        (tmp_path / d / "f.jsonl").write_text("{}\n{}\n")
    (tmp_path / "scratch.py").write_text("untracked\n")
    state = env.git_state()
    assert state["git_dirty"] is False and len(state["git_sha"]) == 40
    (tmp_path / "optim" / "a.py").write_text("x = 2\n")
    assert env.git_state()["git_dirty"] is True


def test_code_id_covers_the_sources_and_the_versions_of_the_stack_and_the_peers(tmp_path, monkeypatch, env_of_a_tree):
    from importlib import metadata

    env = env_of_a_tree
    first = env.code_id()
    assert env.code_versions()["torch"] == metadata.version("torch")
    assert {"transformers", "peft", "liger-kernel", "trl", "unsloth"} <= set(env.code_versions())
    real = env._dist_version
    for dist in ("torch", "peft", "liger-kernel"):  # another version of the stack or a peer: other code
        monkeypatch.setattr(env, "_dist_version", lambda d, dist=dist: "0.0.1" if d == dist else real(d))
        assert env.code_id() != first, dist
    monkeypatch.setattr(env, "_dist_version", real)
    assert env.code_id() == first
    (tmp_path / "harness" / "a.py").write_text("x = 2\n")
    assert env.code_id() != first


def test_cpu_model_reads_the_model_name(tmp_path):
    from harness.measure import env

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9454 48-Core Processor\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9454 48-Core Processor\n")
    assert env.cpu_model(info) == "AMD EPYC 9454 48-Core Processor"
    assert env.cpu_model(tmp_path / "missing")  # falls back to platform's answer, never empty


def test_a_generic_cpu_name_is_told_apart_by_family_model_and_stepping(tmp_path):
    from harness.measure import env

    def info(model):
        return (f"processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\n"
                f"model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 2\n\n"
                "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 999\nmodel name\t: other\n")

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(info(207))
    b.write_text(info(143))
    assert env.cpu_model(a) == "Intel(R) Xeon(R) Processor (cpu family 6, model 207, stepping 2)"
    assert env.cpu_model(a) != env.cpu_model(b)  # one name, two generations


def test_the_host_probe_times_a_fixed_python_workload():
    from harness.measure import env

    small, large = env.host_probe_ms(repeats=3, n=20_000), env.host_probe_ms(repeats=3, n=200_000)
    assert 0 < small < large  # it measures the work, not a constant


def test_collect_records_the_host_cpu_on_every_device():
    from harness.measure import env

    got = env.collect()
    assert got["cpu_model"] == env.cpu_model() and got["host_probe_ms"] > 0
    assert got["host_memory_gib"] == env.host_memory_gib() > 0


def test_host_memory_reads_memtotal(tmp_path):
    from harness.measure import env

    info = tmp_path / "meminfo"
    info.write_text("MemFree:         1024 kB\nMemTotal:       131072000 kB\nSwapTotal: 0 kB\n")
    assert env.host_memory_gib(info) == 125.0  # 131072000 KiB
    # no MemTotal line, or no file: what the system reports, never a wrong number from the file
    info.write_text("MemFree: 1024 kB\n")
    assert env.host_memory_gib(info) == env.host_memory_gib(tmp_path / "missing") > 0


class _FakeNvml:
    """Stands in for pynvml: records which lookup asked for which GPU; it knows two UUIDs."""

    KNOWN = ("GPU-8f0e-aa", "MIG-11-22")

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        if i > 7:
            raise self.NVMLError("Not Found")
        return ("index", i)

    def nvmlDeviceGetHandleByUUID(self, u):
        if u not in self.KNOWN:
            raise self.NVMLError("Not Found")
        return ("uuid", u)


@pytest.mark.parametrize(
    "visible, index, handle",
    [
        (None, 0, ("index", 0)),
        ("2,3", 0, ("index", 2)),
        ("2,3", 1, ("index", 3)),
        ("GPU-8f0e-aa", 0, ("uuid", "GPU-8f0e-aa")),
        ("MIG-11-22", 0, ("uuid", "MIG-11-22")),
        (" 1 ", 0, ("index", 1)),
        ("GPU-8f", 0, ("index", 0)),  # abbreviated: CUDA takes it, NVML does not; NVML's own index, as before
        ("9", 0, ("index", 0)),  # an index NVML does not have
    ],
)
def test_nvml_reads_the_gpu_cuda_visible_devices_names(monkeypatch, visible, index, handle):
    # NVML numbers every GPU on the host: a point pinned to GPU 2 must not read GPU 0's memory
    import sys

    from harness.measure import env

    monkeypatch.setitem(sys.modules, "torch", None)  # no CUDA context in this process
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert env.nvml_handle(_FakeNvml(), index) == handle


@pytest.mark.parametrize("cuda_uuid, handle", [("8f0e-aa", ("uuid", "GPU-8f0e-aa")), ("11-22", ("uuid", "MIG-11-22")),
                                               ("ffff", ("index", 0))])
def test_nvml_reads_the_gpu_of_this_process_cuda_context_by_its_uuid(monkeypatch, cuda_uuid, handle):
    # torch gives the UUID without NVML's prefix; a MIG slice's is NVML's MIG- one
    import sys
    import types

    from harness.measure import env

    props = types.SimpleNamespace(uuid=cuda_uuid)
    cuda = types.SimpleNamespace(is_initialized=lambda: True, get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the context's UUID wins over the variable
    assert env.nvml_handle(_FakeNvml(), 0) == handle
