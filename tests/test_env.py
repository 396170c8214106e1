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


def test_cpu_model_reads_the_model_name(tmp_path):
    from harness.measure import env

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9454 48-Core Processor\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9454 48-Core Processor\n")
    assert env.cpu_model(info) == "AMD EPYC 9454 48-Core Processor"
    assert env.cpu_model(tmp_path / "missing")  # falls back to platform's answer, never empty


def test_collect_records_the_host_cpu_on_every_device():
    from harness.measure import env

    assert env.collect()["cpu_model"] == env.cpu_model()
