"""The GPU suite's shards, checked on CPU: every GPU test runs in exactly one of the README's shards,
and each shard fits an 8-minute GPU command by the wall times recorded on an H100."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DURATIONS, TWO_GPU_FILES, UNKNOWN_FILE_S, shard_files

ROOT = Path(__file__).resolve().parents[1]
# one GPU command is at most 10 minutes; a shard is held to 8, less a minute for start-up and collection
SHARD_BUDGET_S = 7 * 60


def _collect(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:randomly",
                          "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def _readme_shards() -> int:
    specs = re.findall(r"nox -s gpu_tests -- --shard (\d+)/(\d+)", (ROOT / "README.md").read_text())
    counts = {int(n) for _, n in specs}
    assert len(counts) == 1, f"README's shard commands disagree on N: {specs}"
    n = counts.pop()
    assert sorted(int(k) for k, _ in specs) == list(range(1, n + 1)), specs
    return n


@pytest.mark.slow
def test_each_readme_shard_fits_one_gpu_command_by_the_recorded_times():
    n = _readme_shards()
    seconds = json.loads(DURATIONS.read_text())["files"]
    tests = _collect()
    files = list(dict.fromkeys(t.split("::")[0] for t in tests))
    unlisted = [f for f in files if f not in seconds and f not in ("tests/test_cluster.py", "tests/test_distributed.py")]
    assert not unlisted, f"GPU test files with no recorded time (run with --record-durations): {unlisted}"
    shards = shard_files(files, n, seconds)
    assert sorted(f for s in shards for f in s) == sorted(files)
    loads = [sum(seconds.get(f, UNKNOWN_FILE_S) for f in s) for s in shards]
    assert max(loads) <= SHARD_BUDGET_S, f"shard loads {loads} s: more shards in README.md, or faster tests"

    # the hook selects the same files, and the shards together are the whole suite, each test once
    picked = [t for k in range(1, n + 1) for t in _collect("--shard", f"{k}/{n}")]
    assert sorted(picked) == sorted(tests)
    assert len(set(picked)) == len(picked)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8])
def test_the_two_gpu_files_are_always_in_the_first_shard_which_readme_says_needs_two_gpus(n):
    seconds = json.loads(DURATIONS.read_text())["files"]
    files = sorted(seconds)
    assert set(TWO_GPU_FILES) <= set(files)
    shards = shard_files(files, n, seconds)
    assert sorted(f for s in shards for f in s) == files
    assert set(shards[0]) == (set(TWO_GPU_FILES) if n > 1 else set(files))  # alone there: no one-GPU test sees two
    assert "shard 1" in (ROOT / "README.md").read_text().split("## Tests")[1].split("##")[0]
