"""What every row records about where and what ran."""

from __future__ import annotations


def test_code_sha_tracks_the_measuring_code_only(tmp_path, monkeypatch):
    from harness.measure import env

    monkeypatch.setattr(env, "REPO_ROOT", tmp_path)
    for pkg in ("optim", "harness"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    first = env.code_sha()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.py").write_text("y = 2\n")  # not measuring code
    assert env.code_sha() == first
    (tmp_path / "optim" / "a.py").write_text("x = 2\n")
    assert env.code_sha() != first
