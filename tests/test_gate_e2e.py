"""The revisions gate with the real harness on CPU: a copy of this working tree committed into a
temporary repository, both sides swept in worktrees by their own code with tiny models, and the
suite's parity checks run on real models (passing for an equivalent switch, failing for one
planted to change the math)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from harness.cli import main
from harness.measure.env import REPO_ROOT

SUITE = """
[experiment]
name = "gate-cpu"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
device = "cpu"
dtype = "fp32"
lora_rank = 4
bandwidth = false
launcher = "preloaded"
timeout_s = 120
[data]
median_doc_len = 12
[variants.stock]
attn_implementation = "sdpa"
[variants.cache]
packing_backend = "sdpa"
packing_cache = true
[variants.nocache]
packing_backend = "sdpa"
packing_cache = false
[gate]
rounds = 2
# The floors are the guards' plumbing, not a performance target: a CPU runner's load moved one of
# these tiny steps' ratios to 0.44 (a second sweep beside it), so only a 20x loss fails them here.
[[gate.guards]]
switch = "packing_cache"
model = "qwen3-0.6b-tiny"
seq_len = 64
on = "cache"
off = "nocache"
min_speedup = 0.05
[[gate.guards]]
switch = "packing_backend"
model = "qwen3-0.6b-tiny"
seq_len = 64
on = "cache"
off = "stock"
min_speedup = 0.05
"""


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_parity_passes_for_equivalent_switches_and_fails_for_changed_math(tmp_path, monkeypatch, capsys):
    suite = tmp_path / "suite.toml"
    suite.write_text(SUITE)
    out = tmp_path / "parity.json"
    assert main(["parity", str(suite), "--json", str(out)]) == 0
    rows = {r["switch"]: r for r in json.loads(out.read_text())["guards"]}
    # the same math: the cache changes what is rebuilt, and packed SDPA matches stock
    # transformers, which finds the documents from position_ids
    assert rows["packing_cache"]["ok"] and rows["packing_cache"]["grad_rel"] < 1e-5
    assert rows["packing_backend"]["ok"] and rows["packing_backend"]["loss_rel"] < 1e-5

    # plant a bug: packed SDPA's mask loses the document boundaries (plain causal attention)
    import torch

    from optim.packing import backends

    real = backends.build_sdpa_mask

    def causal_only(entry, window, dtype, sink_cols):
        mask = real(entry, window, dtype, sink_cols)
        T = mask.shape[-2]
        out = torch.zeros_like(mask)
        out[..., :T] = torch.full((T, T), float("-inf"), dtype=mask.dtype).triu(1)
        return out

    monkeypatch.setattr(backends, "build_sdpa_mask", causal_only)
    assert main(["parity", str(suite), "--json", str(out)]) == 1
    rows = {r["switch"]: r for r in json.loads(out.read_text())["guards"]}
    assert rows["packing_cache"]["ok"]  # both sides share the bug
    assert not rows["packing_backend"]["ok"] and rows["packing_backend"]["grad_rel"] > 5e-2, rows["packing_backend"]
    assert "FAIL" in capsys.readouterr().out


def test_same_tree_twice_through_real_sweeps_in_worktrees(tmp_path):
    """A/A through the real pipeline: rounds swept by the checked-out code, parity in head's."""
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "harness", "optim",
                            "pyproject.toml"], cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout.split()
    for f in files:
        if (REPO_ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / f, repo / f)
    (repo / "experiments").mkdir()
    (repo / "experiments" / "gate.toml").write_text(SUITE)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "snapshot")
    out = tmp_path / "out"
    assert main(["gate", "--base", "HEAD", "--head", "HEAD", "--repo", str(repo), "--out", str(out)]) == 0
    verdict = json.loads((out / "gate.json").read_text())
    assert verdict["underpowered"] and len(verdict["rounds"]) == 4
    assert {p["variant"] for p in verdict["points"]} == {"stock", "cache", "nocache"}
    assert all(p["base"]["status"] == "ok" and len(p["head"]["step_ms"]) == 2 for p in verdict["points"])
    assert [g["parity"]["ok"] for g in verdict["guards"]] == [True, True]
    rows = [json.loads(line) for f in (out / "rounds").rglob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["step_ms"]["samples"]) == 10 for r in rows)
    assert {r["env"]["git_sha"] for r in rows} == {_git(repo, "rev-parse", "HEAD")}
    assert _git(repo, "worktree", "list").count("\n") == 0
    # each side's rounds ran in one sweep process: round 2 launched its points later in its life
    assert verdict["round_modes"] == {"base": "server", "head": "server"}
    for side in ("base", "head"):
        launched = [[json.loads(line)["launched_s"] for line in f.read_text().splitlines()]
                    for f in sorted((out / "rounds").glob(f"*-{side}/*/*.jsonl"))]
        assert max(launched[0]) < min(launched[1]), launched


@pytest.fixture(autouse=True)
def _no_optim_env(monkeypatch):
    for var in ("OPTIM_PACKING_CACHE", "OPTIM_PACKING_BACKEND"):
        monkeypatch.delenv(var, raising=False)
