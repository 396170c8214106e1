"""``python -m harness gate --base REV --head REV`` orchestration, on a temporary git repository
whose ``harness`` is a stand-in: each revision's ``python -m harness sweep`` writes rows whose step
times and memory its own ``speed.json`` sets, so each outcome is known in advance. The real sweep
and parity in worktrees run in test_gate_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.gate import rounds

FAKE_MAIN = r'''
import json, os, pathlib, random, subprocess, sys, time
cfg = json.loads(pathlib.Path("speed.json").read_text())
sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def order(what):
    if os.environ.get("FAKE_ORDER_LOG"):
        with open(os.environ["FAKE_ORDER_LOG"], "a") as f:
            f.write(f"{what} {sha}\n")


def sweep(args):
    out_arg = args[args.index("--results") + 1]
    order("sweep")
    if cfg.get("fail"):
        print("the suite does not load here", file=sys.stderr)
        return 3
    rng = random.Random(pathlib.Path(out_arg).name)  # the round ("03-head"): the same values every run
    rows = []
    wanted = args[args.index("--variants") + 1:] if "--variants" in args else list(cfg["points"])
    for variant, ms in cfg["points"].items():
        if variant not in wanted:
            continue
        rows.append({"kind": "step", "status": cfg.get("status", {}).get(variant, "ok"), "message": "",
                     "experiment": "gate", "model": "qwen3-0.6b-tiny", "seq_len": 32, "variant": variant,
                     "step_ms": {"p50": ms * (1 + rng.uniform(-0.004, 0.004)), "samples": [ms] * 10},
                     "peak_allocated_gib": cfg.get("peak_gib", {}).get(variant, 1.0),
                     "env": {"git_sha": os.environ.get("FAKE_SHA", sha)}, "device_name": "Fake GPU"})
    path = pathlib.Path(out_arg) / "gate" / "fake-gpu.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def serve():
    # the round server (harness.gate.side's protocol), in revisions whose speed.json says "serve"
    if not cfg.get("serve"):
        print("harness: error: argument COMMAND: invalid choice: '_rounds'", file=sys.stderr)
        return 2
    order("serve")
    if os.environ.get("FAKE_SERVER_PID"):
        pathlib.Path(os.environ["FAKE_SERVER_PID"]).write_text(str(os.getpid()))
    print(json.dumps({"ready": 1}), flush=True)
    for n, line in enumerate(sys.stdin, 1):
        if str(n) == os.environ.get("FAKE_SERVE_DIES_AT"):
            print("the server fell over", file=sys.stderr)
            os._exit(9)
        if str(n) == os.environ.get("FAKE_SERVE_HANGS_AT"):
            time.sleep(600)
        print(json.dumps({"exit": sweep(json.loads(line)["argv"])}), flush=True)
    return 0


def parity(args):
    order("parity")
    ok = cfg.get("parity_ok", True)
    row = {"switch": "packing_cache", "model": "qwen3-0.6b-tiny", "seq_len": 32, "on": "fast", "off": "slow",
           "ok": ok, "loss_rel": 1e-4 if ok else 0.3, "grad_rel": 1e-3 if ok else 0.5,
           "message": "" if ok else "loss 2.0 -> 2.6"}
    pathlib.Path(args[args.index("--json") + 1]).write_text(json.dumps({"guards": [row]}))
    return 0 if ok else 1


args = sys.argv[1:]
sys.exit({"sweep": sweep, "_rounds": lambda a: serve(), "parity": parity}[args[0]](args[1:]))
'''

SUITE = """
[experiment]
name = "gate"
models = ["qwen3-0.6b-tiny"]
seq_lens = [32]
device = "cpu"
bandwidth = false
[variants.fast]
packing_backend = "sdpa"
packing_cache = true
[variants.slow]
packing_backend = "sdpa"
packing_cache = false
[gate]
rounds = 5
[[gate.guards]]
switch = "packing_cache"
model = "qwen3-0.6b-tiny"
seq_len = 32
on = "fast"
off = "slow"
min_speedup = 1.5
"""

BASE = {"points": {"fast": 50.0, "slow": 100.0}}


class Repo(type(Path())):
    """The repository's path, with ``commit(cfg)``."""

    def __new__(cls, path: Path, commit):
        self = super().__new__(cls, path)
        self.commit = commit
        return self


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository with a stand-in harness, its base revision tagged ``base``; ``commit(cfg)``
    commits a head whose sweep reports ``cfg`` and tags it ``head``."""
    r = tmp_path / "repo"
    (r / "harness").mkdir(parents=True)
    (r / "experiments").mkdir()
    (r / "harness" / "__init__.py").write_text("")
    (r / "harness" / "__main__.py").write_text(FAKE_MAIN)
    (r / "experiments" / "gate.toml").write_text(SUITE)
    (r / "speed.json").write_text(json.dumps(BASE))
    _git(r, "init", "-q")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    _git(r, "tag", "base")

    def commit(cfg: dict) -> str:
        (r / "speed.json").write_text(json.dumps(cfg))
        _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "head")
        _git(r, "tag", "-f", "head")
        return _git(r, "rev-parse", "HEAD")

    return Repo(r, commit)


def _gate(repo: Path, out: Path, *extra: str, head: str = "head") -> int:
    return main(["gate", "--base", "base", "--head", head, "--repo", str(repo), "--out", str(out), *extra])


def test_schedule_interleaves_base_and_head_and_flips_who_goes_first():
    assert rounds.schedule(3) == [(1, "base"), (1, "head"), (2, "head"), (2, "base"), (3, "base"), (3, "head")]
    # a clock that slows a little with every slot (a warming GPU): over an even number of rounds
    # both sides see the same mean slot, so a steady drift does not read as a change
    order = rounds.schedule(4)
    slots = {side: [i for i, (_, s) in enumerate(order) if s == side] for side in ("base", "head")}
    assert sum(slots["base"]) == sum(slots["head"])


def test_a_slower_head_fails_rounds_interleaved_and_worktrees_removed(repo, tmp_path, monkeypatch, capsys):
    head = repo.commit({"points": {"fast": 60.0, "slow": 120.0}})  # +20 % everywhere
    base = _git(repo, "rev-parse", "base")
    order = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_ORDER_LOG", str(order))
    out = tmp_path / "out"
    assert _gate(repo, out) == 1
    ran = order.read_text().split("\n")[:-1]
    flip = [f"sweep {base}", f"sweep {head}", f"sweep {head}", f"sweep {base}"]
    assert ran == flip * 2 + [f"sweep {base}", f"sweep {head}", f"parity {head}"]
    assert _git(repo, "worktree", "list").count("\n") == 0  # only the repository's own

    verdict = json.loads((out / "gate.json").read_text())
    assert verdict["outcome"] == "fail" and verdict["exit_code"] == 1
    points = {p["variant"]: p for p in verdict["points"]}
    assert points["fast"]["verdict"] == "SLOWER" and points["fast"]["time"]["low"] > 1.15
    assert len(points["fast"]["base"]["step_ms"]) == 5  # one value per round
    assert len(list((out / "rounds").glob("*/gate/fake-gpu.jsonl"))) == 10  # every round's rows kept
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## Performance gate: FAIL") and "**FAIL SLOWER**" in summary
    assert "| `packing_cache` |" in summary and capsys.readouterr().out.startswith("## Performance gate: FAIL")

    bench = json.loads((out / "benchmark.json").read_text())  # customSmallerIsBetter
    assert all(set(e) >= {"name", "unit", "value"} and isinstance(e["value"], float) for e in bench)
    names = {e["name"]: e for e in bench}
    assert names["qwen3-0.6b-tiny T=32 fast step time"]["unit"] == "ms"
    assert names["qwen3-0.6b-tiny T=32 fast peak memory"]["unit"] == "MiB"
    assert names["guard packing_cache: fast/slow step time"]["value"] == pytest.approx(0.5, abs=0.01)

    # run again into the same directory: every round is read back, none is run
    order.write_text("")
    assert _gate(repo, out) == 1
    assert order.read_text() == ""


def test_same_revision_twice_passes_with_every_interval_holding_one(repo, tmp_path):
    out = tmp_path / "out"
    assert _gate(repo, out, head="base") == 0
    verdict = json.loads((out / "gate.json").read_text())
    for p in verdict["points"]:
        assert p["time"]["low"] <= 1.0 <= p["time"]["high"] and p["outcome"] == "pass", p
    (guard,) = verdict["guards"]
    assert guard["ok"] and guard["head"]["estimate"] == pytest.approx(2.0, rel=0.02)


def test_a_three_percent_slowdown_is_significant_but_below_the_threshold(repo, tmp_path):
    repo.commit({"points": {"fast": 51.5, "slow": 103.0}})
    out = tmp_path / "out"
    assert _gate(repo, out) == 0
    points = {p["variant"]: p for p in json.loads((out / "gate.json").read_text())["points"]}
    assert points["fast"]["time"]["p"] < 0.01 and 1.02 < points["fast"]["time"]["estimate"] < 1.04
    assert points["fast"]["verdict"].startswith("changed +") and points["fast"]["outcome"] == "pass"


def test_256_mib_more_fails_the_memory_check(repo, tmp_path):
    repo.commit({"points": BASE["points"], "peak_gib": {"fast": 1.25}})
    out = tmp_path / "out"
    assert _gate(repo, out) == 1
    points = {p["variant"]: p for p in json.loads((out / "gate.json").read_text())["points"]}
    assert points["fast"]["verdict"] == "MEMORY" and points["fast"]["memory"]["estimate"] == 256
    assert points["slow"]["outcome"] == "pass"


def test_a_switch_that_stops_working_fails_its_guard_by_name(repo, tmp_path):
    repo.commit({"points": {"fast": 100.0, "slow": 100.0}})  # the cache became a no-op
    out = tmp_path / "out"
    assert _gate(repo, out) == 1
    summary = (out / "summary.md").read_text()
    assert re.search(r"guard `packing_cache` \(qwen3-0.6b-tiny T=32\): speedup (0\.99|1\.00)\dx below its floor 1.5x", summary)
    # the fast point also got slower, but the guard line is what names the switch
    assert "**FAIL SLOWER**" in summary


def test_a_parity_failure_fails_its_guard(repo, tmp_path):
    repo.commit({**BASE, "parity_ok": False})
    out = tmp_path / "out"
    assert _gate(repo, out) == 1
    (guard,) = json.loads((out / "gate.json").read_text())["guards"]
    assert not guard["ok"] and guard["reasons"] == ["parity failed: loss 2.0 -> 2.6"]


def test_ok_in_base_and_error_in_head_fails(repo, tmp_path):
    repo.commit({**BASE, "status": {"slow": "oom"}})
    assert _gate(repo, tmp_path / "out") == 1
    points = {p["variant"]: p for p in json.loads((tmp_path / "out" / "gate.json").read_text())["points"]}
    assert points["slow"]["verdict"] == "ok -> oom"


def test_unusable_input_exits_2_with_one_message(repo, tmp_path, capsys):
    assert _gate(repo, tmp_path / "a", head="no-such-rev") == 2
    assert "'no-such-rev' names no commit" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "gate.json").read_text())["outcome"] == "error"

    repo.commit({**BASE, "fail": True})  # head's checkout cannot run the suite
    assert _gate(repo, tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "round 1 (head," in err and "the suite does not load here" in err
    assert _git(repo, "worktree", "list").count("\n") == 0

    assert main(["gate", "--base", "base", "--repo", str(repo)]) == 2  # half of a mode
    assert main(["gate", "--base", "base", "--head", "head", "--baseline", "x", "--candidate", "y"]) == 2
    suite = tmp_path / "not-a-suite.toml"
    suite.write_text(SUITE.split("[gate]")[0])
    assert _gate(repo, tmp_path / "c", "--suite", str(suite)) == 2
    assert "not a gate suite" in capsys.readouterr().err


def test_a_round_whose_rows_hold_no_step_time_stops_the_gate_with_exit_2(repo, tmp_path, capsys):
    """A NaN step time (a broken timer in head) would read as no change; the rows are checked as
    the files mode checks them, and the gate stops with one message, its summary saying ERROR."""
    repo.commit({"points": {"fast": 50.0, "slow": float("nan")}})
    assert _gate(repo, tmp_path / "out") == 2
    assert "ok row without a positive step_ms.p50 (got nan)" in capsys.readouterr().err
    assert (tmp_path / "out" / "summary.md").read_text().startswith("## Performance gate: ERROR")


def test_a_crash_inside_the_gate_is_an_error_not_a_verdict(repo, tmp_path, monkeypatch, capsys):
    from harness.gate import revisions

    def broken(*_a, **_k):
        raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'float'")

    monkeypatch.setattr(revisions, "run", broken)
    assert _gate(repo, tmp_path / "out") == 2
    assert "the gate itself failed (TypeError" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "gate.json").read_text())["outcome"] == "error"


def test_rows_measured_elsewhere_are_refused(repo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SHA", "0" * 40)  # as if an installed copy of harness ran, not the checkout
    assert _gate(repo, tmp_path / "out", head="base") == 2
    assert "is `harness` imported from elsewhere" in capsys.readouterr().err


def test_another_gates_directory_is_not_mixed_in(repo, tmp_path, capsys):
    out = tmp_path / "out"
    assert _gate(repo, out, "--rounds", "2", head="base") == 0
    repo.commit({**BASE, "changed": True})
    assert _gate(repo, out, "--rounds", "2") == 2
    assert "holds the rounds of another gate" in capsys.readouterr().err


def test_underpowered_rounds_are_said(repo, tmp_path):
    out = tmp_path / "out"
    assert _gate(repo, out, "--rounds", "3", head="base") == 0
    summary = (out / "summary.md").read_text()
    assert "with 3 rounds per side no p-value can fall below 0.01" in summary
    assert json.loads((out / "gate.json").read_text())["underpowered"] is True



def test_judged_variants_every_round_and_the_guards_others_in_heads_first_rounds(repo, tmp_path):
    suite = tmp_path / "suite.toml"
    suite.write_text(SUITE.replace("rounds = 5", 'rounds = 5\njudge = ["fast"]\nguard_rounds = 2'))
    out = tmp_path / "out"
    assert _gate(repo, out, "--suite", str(suite), head="base") == 0
    ran = {d.name: {json.loads(line)["variant"] for line in (d / "gate" / "fake-gpu.jsonl").read_text().splitlines()}
           for d in (out / "rounds").iterdir()}
    assert ran["01-head"] == ran["02-head"] == {"fast", "slow"}
    assert all(ran[f"{n:02d}-base"] == {"fast"} for n in range(1, 6))
    assert all(ran[f"{n:02d}-head"] == {"fast"} for n in range(3, 6))
    verdict = json.loads((out / "gate.json").read_text())
    assert [p["variant"] for p in verdict["points"]] == ["fast"]  # "slow" exists for its guard only
    (guard,) = verdict["guards"]
    assert guard["ok"] and guard["head"]["estimate"] == pytest.approx(2.0, rel=0.02) and guard["base"] is None


def test_a_side_with_a_round_server_runs_all_its_rounds_in_it(repo, tmp_path, monkeypatch, capsys):
    """Base predates the round server (its sweeps run one process per round); head has one, started
    once, for all five of its rounds, in the same interleaved order."""
    head = repo.commit({**BASE, "serve": True})
    base = _git(repo, "rev-parse", "base")
    order = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_ORDER_LOG", str(order))
    out = tmp_path / "out"
    assert _gate(repo, out) == 0
    assert order.read_text().split("\n")[:-1] == (
        [f"sweep {base}", f"serve {head}", f"sweep {head}"]
        + [f"sweep {head}", f"sweep {base}", f"sweep {base}", f"sweep {head}"] * 2 + [f"parity {head}"])
    verdict = json.loads((out / "gate.json").read_text())
    assert verdict["round_modes"] == {"base": "fresh", "head": "server"}
    assert "base ran one fresh sweep process per round; head ran one sweep process for all its rounds" in (
        out / "summary.md").read_text()
    assert "base: its round server did not start (harness: error: argument COMMAND: invalid choice: '_rounds'" in (
        capsys.readouterr().err)


def test_a_round_server_that_dies_stops_the_gate_and_a_rerun_resumes(repo, tmp_path, monkeypatch, capsys):
    repo.commit({**BASE, "serve": True})
    _git(repo, "tag", "-f", "base")  # both sides serve
    repo.commit({**BASE, "serve": True, "other": 1})
    order = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_ORDER_LOG", str(order))
    monkeypatch.setenv("FAKE_SERVE_DIES_AT", "3")  # each side's third round
    out = tmp_path / "out"
    assert _gate(repo, out) == 2
    err = capsys.readouterr().err
    assert "the base side's round server stopped mid-round" in err and "the server fell over" in err
    assert json.loads((out / "gate.json").read_text())["outcome"] == "error"
    assert len(list((out / "rounds").glob("*/done.json"))) == 4  # rounds 1-2 of both sides kept
    assert _git(repo, "worktree", "list").count("\n") == 0

    monkeypatch.delenv("FAKE_SERVE_DIES_AT")
    order.write_text("")
    assert _gate(repo, out) == 0
    ran = order.read_text().split("\n")[:-1]
    assert [r.split()[0] for r in ran] == ["serve", "sweep", "serve"] + ["sweep"] * 5 + ["parity"]
    assert json.loads((out / "gate.json").read_text())["round_modes"] == {"base": "server", "head": "server"}


def test_a_round_hung_in_its_server_is_killed_at_the_round_timeout(repo, tmp_path, monkeypatch, capsys):
    repo.commit({**BASE, "serve": True})
    pid_file = tmp_path / "server.pid"
    monkeypatch.setenv("FAKE_SERVER_PID", str(pid_file))
    monkeypatch.setenv("FAKE_SERVE_HANGS_AT", "1")
    t0 = time.monotonic()
    assert _gate(repo, tmp_path / "out", "--round-timeout", "3") == 2
    assert time.monotonic() - t0 < 60
    assert "round 1 (head) ran past 3 s" in capsys.readouterr().err
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_fresh_rounds_runs_one_process_per_round_even_where_a_server_exists(repo, tmp_path, monkeypatch):
    head = repo.commit({**BASE, "serve": True})
    order = tmp_path / "order.log"
    monkeypatch.setenv("FAKE_ORDER_LOG", str(order))
    assert _gate(repo, tmp_path / "out", "--fresh-rounds") == 0
    assert f"serve {head}" not in order.read_text()
    assert json.loads((tmp_path / "out" / "gate.json").read_text())["round_modes"] == {"base": "fresh", "head": "fresh"}
