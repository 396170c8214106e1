"""tools/gpu_suite.py: the GPU suite's shards planned over a host's GPUs and run as real pytest
processes, a failing shard failing the run."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "tools" / "gpu_suite.py")
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)


def test_shard_one_takes_two_gpus_and_the_rest_go_to_the_lane_free_soonest():
    seconds = [130.0, 400.0, 300.0, 200.0, 250.0, 310.0, 290.0]
    lanes = suite.plan(["0", "1", "2", "3"], seconds)
    assert lanes[0][0] == (1, "0,1") and all(k != 1 for lane in lanes[1:] for k, _ in lane)
    assert sorted(k for lane in lanes for k, _ in lane) == list(range(1, 8))
    assert all(gpus == str(i) for i, lane in enumerate(lanes) for k, gpus in lane if k != 1)
    # lanes 2 and 3 start at once with the two longest; every lane ends within the longest shard of the others
    assert [lane[0][0] for lane in lanes[2:]] == [2, 6]
    ends = [sum(seconds[k - 1] for k, _ in lane) + (seconds[0] if i == 1 else 0) for i, lane in enumerate(lanes)]
    assert max(ends) - min(ends) <= max(seconds)
    # one GPU: every shard in turn on it; one shard: one GPU, whatever is visible
    assert suite.plan(["5"], seconds) == [[(1, "5"), (2, "5"), (6, "5"), (3, "5"), (7, "5"), (5, "5"), (4, "5")]]
    assert suite.plan(["0", "1"], [10.0]) == [[(1, "0")], []]
    # a selection that leaves one-GPU tests in shard 1: one GPU for it too, and lane 1 starts at once
    assert suite.plan(["0", "1"], seconds, two=False)[0][0] == (1, "0") and suite.plan(["0", "1"], seconds, two=False)[1]
    assert len(suite.shard_seconds(7)) == 7 and all(s > 0 for s in suite.shard_seconds(7))


def test_the_shards_run_as_pytest_processes_and_a_failing_one_fails_the_run(tmp_path, capsys):
    # the CPU tests of one file, through the same shards: one shard runs them, the other has none
    assert suite.main(["--gpus", "0", "1", "--shards", "2", "--logs", str(tmp_path / "ok"), "--",
                       "-m", "not gpu", "tests/test_memtrace.py"]) == 0
    out = capsys.readouterr().out
    assert "every shard passed" in out and re.search(r"\n.*1/2 .* (\d+) passed", out), out
    assert re.search(r"\n.*2/2 .* (\d+) deselected", out), out  # the other shard: that file deselected
    assert "0,1" not in out  # shard 1 held a one-GPU file: it saw one GPU
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["shard-1-of-2.log", "shard-2-of-2.log"]
    # pytest refusing its arguments is a failed shard, named, and the run's exit status
    assert suite.main(["--gpus", "0", "--shards", "2", "--logs", str(tmp_path / "bad"), "--", "--no-such-option"]) == 1
    out = capsys.readouterr().out
    assert "failed: shard(s) 1, 2" in out and "[exit 4]" in out, out


def test_a_shard_past_its_time_is_killed_and_fails_and_the_visible_gpus_are_the_schedulers(tmp_path, capsys,
                                                                                           monkeypatch):
    assert suite.main(["--gpus", "0", "--shards", "2", "--timeout", "0.2", "--logs", str(tmp_path), "--",
                       "tests/test_memtrace.py"]) == 1
    out = capsys.readouterr().out
    table = out[out.index("  shard  GPUs"):]  # each shard's line is also printed as it ends, above the table
    assert table.count("[exit timeout]") == 2 and "failed: shard(s) 1, 2" in out, out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert suite.visible_gpus() == ["2", "3"]


def test_only_runs_the_named_shards_and_lists_the_rest_as_not_run(tmp_path, capsys):
    """A share of the suite, where one call cannot hold it all: the named shards run as the full
    plan would run them, the others are listed as not run and fail nothing; a name out of range is
    one clear error."""
    assert suite.main(["--gpus", "0", "1", "--shards", "3", "--only", "2", "--logs", str(tmp_path), "--",
                       "-m", "not gpu", "tests/test_memtrace.py"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n.*2/3 .*deselected", out) and "every shard run passed; not run: 1, 3" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-2-of-3.log"]
    import pytest

    with pytest.raises(SystemExit):
        suite.main(["--gpus", "0", "--shards", "3", "--only", "4"])


def test_each_shard_is_printed_as_it_ends_and_stop_after_starts_no_more(tmp_path, capsys):
    """A call with a time limit: a shard's line is printed when it ends (a killed run still shows
    what finished), and past --stop-after no shard starts; those are listed as not run, which
    fails nothing, so the next call runs them with --only."""
    assert suite.main(["--gpus", "0", "--shards", "3", "--stop-after", "0", "--logs", str(tmp_path), "--",
                       "-m", "not gpu", "tests/test_memtrace.py"]) == 0
    out = capsys.readouterr().out
    assert out.count("not started (--stop-after)") == 3 and "not run: 1, 2, 3" in out, out
    assert not list(tmp_path.iterdir())
    assert suite.main(["--gpus", "0", "--shards", "2", "--logs", str(tmp_path), "--",
                       "-m", "not gpu", "tests/test_memtrace.py"]) == 0
    out = capsys.readouterr().out
    ended = [line for line in out.splitlines() if re.match(r"\[\s*\d+ s\]", line)]
    assert len(ended) == 2 and out.index(ended[-1]) < out.index("  shard  GPUs"), out  # before the table


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the lane dies on purpose
def test_a_lane_that_dies_is_no_result_even_with_stop_after(tmp_path, capsys, monkeypatch):
    """Only the shards the deadline kept from starting are "not run"; a shard missing for any other
    reason (its lane's thread died) fails the run."""
    line, calls = suite._line, []

    def first_raises(r, n):
        calls.append(r["shard"])
        if len(calls) == 1:
            raise RuntimeError("the lane dies")
        return line(r, n)

    monkeypatch.setattr(suite, "_line", first_raises)
    assert suite.main(["--gpus", "0", "--shards", "2", "--stop-after", "1000", "--logs", str(tmp_path), "--",
                       "-m", "not gpu", "tests/test_memtrace.py"]) == 1
    out = capsys.readouterr().out
    assert "failed: shard(s) 2" in out and "not started" not in out, out
