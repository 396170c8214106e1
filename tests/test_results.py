"""The results store: atomic appends, point replacement, loud failure on corrupt rows."""

import json

import pytest

from harness import results as res


def test_append_and_replace(tmp_path):
    path = res.results_path(tmp_path, "exp", res.gpu_slug("NVIDIA H100 80GB HBM3"))
    assert path.name == "nvidia-h100-80gb-hbm3.jsonl"
    res.append_row(path, {"kind": "step", "point_id": "a", "status": "error"})
    res.append_row(path, {"kind": "step", "point_id": "b", "status": "ok"})
    assert res.finished_point_ids(path) == {"b"}
    res.append_row(path, {"kind": "step", "point_id": "a", "status": "ok", "x": 1}, replace_point=True)
    rows = res.read_rows(path)
    assert [r["point_id"] for r in rows] == ["b", "a"] and rows[1]["x"] == 1
    assert all(r["schema"] == res.SCHEMA_VERSION for r in rows)
    assert res.finished_point_ids(path) == {"a", "b"}
    # no temporary files are left beside the results
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == [path.name]


def test_oom_counts_as_finished_error_does_not(tmp_path):
    path = tmp_path / "e" / "cpu.jsonl"
    res.append_row(path, {"kind": "step", "point_id": "o", "status": "oom"})
    res.append_row(path, {"kind": "step", "point_id": "e", "status": "error"})
    assert res.finished_point_ids(path) == {"o"}


def test_corrupt_row_is_an_error_not_silently_dropped(tmp_path):
    path = tmp_path / "e" / "cpu.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"point_id": "a"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"cpu.jsonl:2: not a whole result row"):
        res.read_rows(path)
    before = path.read_text()
    with pytest.raises(ValueError):
        res.append_row(path, {"point_id": "b"})
    assert path.read_text() == before  # nothing written over a file we could not read


def test_a_bench_rerun_with_another_loss_or_attention_keeps_the_earlier_rows():
    """The offload bench's full-loss rows sit beside its chunked-loss rows (their peaks differ by
    the logits), and the Trainer bench's sdpa rows beside its flex rows: each setting is its own
    measurement; the same setting again replaces its row."""
    offload = {"kind": "offload", "model": "m", "seq_len": 2048, "mode": "double", "loss_mode": "chunked",
               "dtype": "bf16", "attn": "sdpa"}
    assert res.bench_key(offload) != res.bench_key({**offload, "loss_mode": "full"})
    assert res.bench_key(offload) != res.bench_key({**offload, "attn": "flex_attention"})
    trainer = {"kind": "trainer", "model": "m", "mode": "graphed", "tokens": 2048, "attn_implementation": "flex_attention",
               "experts_implementation": "grouped_mm"}
    assert res.bench_key(trainer) != res.bench_key({**trainer, "attn_implementation": "sdpa"})
    assert res.bench_key(trainer) == res.bench_key({**trainer, "ms": 1.0})
