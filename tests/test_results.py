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
