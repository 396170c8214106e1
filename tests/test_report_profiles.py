"""The profile section: phases and kernel families of a profiled step."""

from __future__ import annotations

import json

import pytest
from _report import (
    H100,
)

from harness import report
from harness.report import fmt, profiles


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _profile_summary(**over):
    s = {"model": "gpt-oss-20b", "seq_len": 8192, "variant": "ours", "steps": 1, "device_name": "NVIDIA H100",
         "profiled": "eager steps",
         "phases": {"forward": {"gpu_span_ms": 200.0, "cpu_span_ms": 150.0, "gpu_busy_pct": 75.0, "launches": 10,
                                "host_syncs": 0}},
         "top_kernels": [{"name": "cutlass_GroupProblemShape_x", "ms": 300.0, "count": 4},
                         {"name": "triton_tem_fused_flex_attention_backward", "ms": 100.0, "count": 2},
                         {"name": "Memcpy DtoD (Device -> Device)", "ms": 50.0, "count": 9},
                         {"name": "masked_fill_kernel", "ms": 30.0, "count": 9}],
         "kernel_ms_total": 500.0}
    return {**s, **over}


def test_profile_section_splits_kernel_time_by_family(tmp_path):
    _write(tmp_path / "x" / "profiles" / H100 / "a.summary.json", _profile_summary())
    with fmt.recording() as tables:
        text = report.build_report(tmp_path, "x", tmp_path / "reports").read_text()
    assert "## Where the step's time goes (profiles)" in text
    phase = tables.find("GPU span ms").row(phase="forward")
    assert [phase[k] for k in ("GPU span ms", "host span ms", "GPU busy", "launches", "host syncs")] == [200.0, 150.0, 75.0, 10, 0]
    kinds = {r["kernel family"]: (r["ms per step"], r["of kernel time"], r["ms per 1k tokens"])
             for r in tables.find("kernel family").rows()}
    per_k = 1024 / 8192
    assert kinds == {
        "grouped GEMM (torch grouped_mm)": (300.0, 60.0, 300.0 * per_k),
        "attention": (100.0, 20.0, 100.0 * per_k),
        "copies and fills": (50.0, 10.0, 50.0 * per_k),
        "other (elementwise, reductions, indexing)": (30.0, 6.0, 30.0 * per_k),  # masked_fill is not a fill
        "kernels outside the top 4": (20.0, 4.0, 20.0 * per_k),
        "all kernels": (500.0, 100.0, 500.0 * per_k),
    }
    (tmp_path / "x" / "profiles" / H100 / "b.summary.json").write_text('{"phases": {}}')
    with pytest.raises(profiles.ProfileFileError, match="b.summary.json: not a harness profile summary"):
        report.build_report(tmp_path, "x", tmp_path / "reports")


def test_a_profile_says_which_commit_measured_it(tmp_path):
    env = {"git_sha": "0123456789abcdef", "git_dirty": False, "code_sha": "feed"}
    _write(tmp_path / "x" / "profiles" / H100 / "a.summary.json", _profile_summary(env=env))
    _write(tmp_path / "x" / "profiles" / H100 / "b.summary.json",
           _profile_summary(variant="stock", env={**env, "git_dirty": True}))
    _write(tmp_path / "x" / "profiles" / H100 / "c.summary.json", _profile_summary(variant="liger"))
    text = report.build_report(tmp_path, "x", tmp_path / "reports").read_text()
    parts = {v: text.split(f"`{v}` on")[1].split("|")[0] for v in ("ours", "stock", "liger")}
    assert "measured at commit `0123456`." in parts["ours"]
    assert "measured at commit `0123456` with uncommitted changes." in parts["stock"]
    assert "measured at" not in parts["liger"]  # a summary from before they recorded it
