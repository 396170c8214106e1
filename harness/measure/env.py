"""The environment recorded with every run: GPU, driver, CUDA, library versions, git, PCIe, clocks."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - a missing optional library is just "unknown"
        return None


def _dist_version(dist: str) -> str | None:
    """An installed distribution's version without importing it (Liger imports Triton)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def nvml_handle(pynvml, index: int = 0):
    """NVML's handle for the CUDA device this process calls ``index``.

    NVML numbers every GPU on the host and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers the
    visible ones. A point pinned to the host's third GPU is CUDA device 0, and NVML's device 0 is
    someone else's GPU. Matched by UUID when this process has a CUDA context, else through
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID per entry), so that naming the device before a
    sweep creates no context. Where NVML knows no such UUID (an abbreviated one, a MIG slice's
    older form) it falls back to NVML's own index, as before."""
    uuid = None
    torch = sys.modules.get("torch")  # not imported: no context, and none made here
    try:
        if torch is not None and torch.cuda.is_initialized():
            uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - no CUDA: fall back to the environment
        pass
    if uuid is None:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if index < len(visible):
            entry = visible[index]
            if entry.isdigit():
                try:
                    return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                except pynvml.NVMLError:
                    return pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = entry
    if uuid is not None:
        bare = uuid.split("-", 1)[1] if uuid.startswith(("GPU-", "MIG-")) else uuid
        for name in dict.fromkeys((uuid, f"GPU-{bare}", f"MIG-{bare}")):  # CUDA's string has no prefix
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(name)
            except pynvml.NVMLError:
                continue
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_info(index: int = 0) -> dict:
    """PCIe link, clocks and power limit read from NVML; empty when there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    info: dict = {}
    try:
        try:
            h = nvml_handle(pynvml, index)
        except pynvml.NVMLError:
            return {}  # a GPU NVML cannot name: no readings, and the row still stands
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        reads = {
            "pcie_gen": lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            "pcie_width": lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
            "pcie_max_gen": lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
            "pcie_max_width": lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            "sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "power_limit_w": lambda: pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0,
            "memory_total_gib": lambda: pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30,
        }
        for key, read in reads.items():
            try:
                info[key] = read()
            except pynvml.NVMLError:
                info[key] = None
    finally:
        pynvml.nvmlShutdown()
    return info


def pcie_ceiling_gbps(gen: int | None, width: int | None) -> float | None:
    """Theoretical one-direction PCIe payload rate in GB/s (128b/130b encoding from Gen3 on)."""
    per_lane_gtps = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
    if not gen or not width or gen not in per_lane_gtps:
        return None
    encoding = 0.8 if gen <= 2 else 128 / 130
    return per_lane_gtps[gen] * encoding * width / 8


def nvml_memory_gib(index: int = 0) -> tuple[float | None, float | None]:
    """(device memory used by everyone, memory used by this process) in GiB, from NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None, None
    try:
        try:
            h = nvml_handle(pynvml, index)
        except pynvml.NVMLError:
            return None, None
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
        mine = None
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    mine = p.usedGpuMemory / 2**30
        except pynvml.NVMLError:
            pass
        return used, mine
    finally:
        pynvml.nvmlShutdown()


def git_state() -> dict:
    """The commit measured, and whether tracked files outside results/ and reports/ had changes on
    top of it. A copy of the tree without .git (a GPU machine the tree was copied to) takes both
    from PACKBENCH_GIT_SHA / PACKBENCH_GIT_DIRTY set by whoever shipped the tree."""
    # Whoever shipped the tree knows best: a copy may carry a stale .git (a machine the tree is
    # copied to again and again may keep the .git of the first copy while the files move on).
    if not os.environ.get("PACKBENCH_GIT_SHA"):
        sha = _git("rev-parse", "HEAD")
        if sha is not None:
            # the rows a sweep appends to results/ (and the reports built from them) change tracked
            # files as it runs: they are what it measured, not what it measured with
            changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                           ":(exclude)results", ":(exclude)reports")
            return {"git_sha": sha, "git_dirty": None if changed is None else bool(changed)}
    dirty = os.environ.get("PACKBENCH_GIT_DIRTY")
    return {"git_sha": os.environ.get("PACKBENCH_GIT_SHA"),
            "git_dirty": None if dirty is None else dirty.lower() in ("1", "true", "yes")}


def code_sha() -> str:
    """A hash of the measuring code itself (optim/ and harness/ sources): two rows with the same
    value ran the same code even when the commits differ (a commit that only adds results or
    tools), so they may be compared as one run."""
    import hashlib

    h = hashlib.sha256()
    for pkg in ("optim", "harness"):
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# The installed distributions whose version can change what a point measures: the stack it runs on
# and the peers it compares with. ``code_id`` hashes their versions with ``code_sha``.
CODE_DISTRIBUTIONS = ("torch", "triton", "transformers", "peft", "liger-kernel", "trl", "unsloth",
                      "unsloth-zoo", "cut-cross-entropy")


def code_versions() -> dict[str, str | None]:
    """``CODE_DISTRIBUTIONS``' installed versions, read without importing them (None: not installed)."""
    return {dist: _dist_version(dist) for dist in CODE_DISTRIBUTIONS}


def code_id(sha: str | None = None) -> str:
    """The code identity a row records (``env.code_id``) and a sweep resumes on: ``code_sha`` (the
    sources of optim/ and harness/; ``sha`` when already read) and ``code_versions``, hashed. A row
    of another code_id was measured by other code; the sweep measures its point again unless told
    to keep it."""
    import hashlib
    import json

    value = json.dumps({"code_sha": sha or code_sha(), **code_versions()}, sort_keys=True)
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def cpu_model(cpuinfo: Path | str = "/proc/cpuinfo") -> str:
    """The host processor's model name (``model name`` of /proc/cpuinfo on Linux), else what
    ``platform`` knows. Recorded on GPU rows too: an eager step that waits on the host runs at the
    host's speed, while a graphed or GPU-bound one does not.

    A virtual machine often shows a generic name ("Intel(R) Xeon(R) Processor"), so the CPU family,
    model and stepping follow it where /proc/cpuinfo has them: two hosts of one name but another
    generation then differ."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if not key and fields:
                break  # the first processor's block is enough
            if value:
                fields.setdefault(key, value)
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model name") or fields.get("cpu model")
    if not name:
        return platform.processor() or platform.machine()
    ident = [f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields]
    return f"{name} ({', '.join(ident)})" if ident else name


def host_memory_gib(meminfo: Path | str = "/proc/meminfo") -> float | None:
    """The host's memory in GiB (``MemTotal`` of /proc/meminfo on Linux, else what ``os.sysconf``
    gives; None where neither does): what offloaded checkpoints in pinned host memory share with
    everything else on the host, the bound of a long sequence that offloads."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "MemTotal" and value.split() and value.split()[0].isdigit():
                return round(int(value.split()[0]) * 1024 / 2**30, 2)  # the kernel counts kB (KiB)
    except OSError:
        pass
    try:
        return round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)
    except (AttributeError, ValueError, OSError):
        return None


def host_probe_ms(repeats: int = 5, n: int = 100_000) -> float:
    """How long this host takes for a fixed piece of pure Python (a small function called ``n``
    times, with the attribute and dict lookups a kernel launch's Python path makes), the median of
    ``repeats``, in ms. Lower is faster. An eager step that waits on the host scales with it, so two
    runs of one configuration that disagree can be told apart by it: the same code on a slower or
    busier host shows a larger probe. Comparable between rows of one Python version."""
    import statistics
    import time

    class _Op:
        __slots__ = ("shape",)

        def __init__(self):
            self.shape = (1, 2)

    def launch(op, table):
        return table.get(op.shape[0], 0) + len(op.shape)

    op, table, times = _Op(), {1: 1}, []
    for _ in range(repeats):
        t = time.perf_counter()
        acc = 0
        for _ in range(n):
            acc += launch(op, table)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def light() -> dict:
    """What ``collect`` records without importing torch or asking the GPU: the code's identity
    (``code_id``), the versions, the commit and the host. The sweep process stamps it on a row the
    point's process could not write (it died), so that row too says which code measured it."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
        "peft": _dist_version("peft"),
        "triton": _dist_version("triton"),
        "liger_kernel": _dist_version("liger-kernel"),
        "trl": _dist_version("trl"),
        "cut_cross_entropy": _dist_version("cut-cross-entropy"),
        # the Unsloth stack's, and the attention kernels it picks where they are installed
        "unsloth": _dist_version("unsloth"),
        "unsloth_zoo": _dist_version("unsloth-zoo"),
        "flash_attn": _dist_version("flash-attn"),
        "xformers": _dist_version("xformers"),
        **git_state(),
        "code_sha": (sha := code_sha()),
        "code_id": code_id(sha),  # the sources are read once
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "host_memory_gib": host_memory_gib(),
    }


def collect() -> dict:
    import torch

    env = {
        **light(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "host_probe_ms": host_probe_ms(),
    }
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_count"] = torch.cuda.device_count()
        env.update(nvml_info(0))
    else:
        env["device_name"] = "cpu"
        env["device_count"] = 0
    return env
