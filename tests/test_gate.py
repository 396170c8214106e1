"""The regression gate: a candidate's rows against a baseline's, paired on what each point
measures; fails on slowdown beyond threshold-or-noise, memory growth and new OOMs; refuses
unusable input with one error naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import gate
from harness import results as res
from harness.cli import main
from harness.measure.env import REPO_ROOT

H100 = "NVIDIA H100 80GB HBM3"


def step_row(variant="sdpa", seq_len=2048, repeat=0, p50=100.0, spread=0.01, peak=5.0, status="ok",
             device=H100, model="qwen3-0.6b", **extra) -> dict:
    """A step row as a sweep writes it; ``spread`` sets p80/p20 - 1 of the step samples."""
    row = {
        "kind": "step", "experiment": "ci", "model": model, "family": "qwen3", "seq_len": seq_len,
        "batch_size": 1, "variant": variant, "baseline_variant": "sdpa", "gpus": 1, "repeat": repeat,
        "switches": {"attn_implementation": variant, "gradient_checkpointing": True},
        "warmup_steps": 3, "measured_steps": 10, "lora_rank": 16, "dtype": "bf16",
        "point_id": f"{model}-{seq_len}-{variant}-r{repeat}", "status": status, "message": "",
        "device_name": device, "gpu_slug": res.gpu_slug(device), "env": {"git_sha": "abc123"},
    }
    if status == "ok":
        p20, p80 = p50 * (1 - spread / 2), p50 * (1 - spread / 2) * (1 + spread)
        row.update(step_ms={"p20": p20, "p50": p50, "p80": p80, "samples": [p20, p50, p80]},
                   peak_allocated_gib=peak)
    else:
        row["message"] = "CUDA out of memory. Tried to allocate 2.00 GiB" if status == "oom" else "RuntimeError: boom"
    row.update(extra)
    return row


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gate_files(tmp_path, base_rows, cand_rows, **kw) -> gate.GateResult:
    base = write(tmp_path / "base" / "nvidia-h100.jsonl", base_rows)
    cand = write(tmp_path / "cand" / "nvidia-h100.jsonl", cand_rows)
    return gate.run(base, cand, **kw)


def only(result: gate.GateResult) -> gate.PointResult:
    (point,) = result.points
    return point


def test_same_speed_passes(tmp_path):
    bandwidth = {"kind": "bandwidth", "status": "ok", "device_name": H100, "gbps": {"p50": 25.0}}
    base = [step_row("sdpa"), step_row("flex", p50=80.0), bandwidth]
    cand = [step_row("sdpa", p50=102.0), step_row("flex", p50=79.0)]
    result = gate_files(tmp_path, base, cand)
    assert result.exit_code == 0 and not result.failed and not result.warned
    assert [p.label for p in result.points] == ["qwen3-0.6b T=2048 bs=1 sdpa", "qwen3-0.6b T=2048 bs=1 flex"]
    assert result.points[0].ratio == pytest.approx(1.02) and result.points[0].bound == "threshold"
    assert result.summary().startswith("gate: PASS: 0 of 2 points regressed")


def test_slowdown_beyond_threshold_fails(tmp_path):
    point = only(gate_files(tmp_path, [step_row(p50=100.0)], [step_row(p50=110.0)]))
    assert point.outcome == "fail" and point.verdict == "SLOWER"
    assert point.allowed_slowdown == pytest.approx(0.05) and point.bound == "threshold"
    assert "+10.0% > allowed +5.0% (threshold)" in point.reasons[0]
    # a looser threshold lets it through; a faster candidate is reported as such
    assert only(gate_files(tmp_path, [step_row(p50=100.0)], [step_row(p50=110.0)], max_slowdown=0.15)).outcome == "pass"
    assert only(gate_files(tmp_path, [step_row(p50=100.0)], [step_row(p50=80.0)])).verdict == "faster"


def test_noise_widens_the_allowed_slowdown(tmp_path):
    base, cand = [step_row(p50=100.0, spread=0.20)], [step_row(p50=110.0, spread=0.02)]
    point = only(gate_files(tmp_path, base, cand))
    assert point.outcome == "pass" and point.verdict == "ok"
    assert point.allowed_slowdown == pytest.approx(0.20) and point.bound == "noise: base p80/p20"
    off = only(gate_files(tmp_path, base, cand, noise="off"))
    assert off.outcome == "fail" and off.bound == "threshold"
    # the candidate's own spread counts too, and a noisy slowdown beyond the spread still fails
    assert only(gate_files(tmp_path, [step_row(spread=0.0)], [step_row(p50=110.0, spread=0.12)])).bound == "noise: cand p80/p20"
    assert only(gate_files(tmp_path, base, [step_row(p50=125.0)])).outcome == "fail"


def test_memory_growth_fails(tmp_path):
    point = only(gate_files(tmp_path, [step_row(peak=5.0)], [step_row(peak=5.6)]))
    assert point.outcome == "fail" and point.verdict == "MEMORY"
    assert point.memory_growth == pytest.approx(0.12) and "5.00 → 5.60 GiB" in point.reasons[0]
    both = only(gate_files(tmp_path, [step_row(peak=5.0)], [step_row(p50=120.0, peak=6.0)]))
    assert both.verdict == "SLOWER+MEMORY" and len(both.reasons) == 2
    # CPU rows have no peak memory: nothing to compare, no failure
    cpu = only(gate_files(tmp_path, [step_row(peak=None, device="cpu")], [step_row(peak=None, device="cpu")]))
    assert cpu.outcome == "pass" and cpu.memory_growth is None


def test_ok_to_oom_or_error_fails_and_the_reverse_passes(tmp_path):
    point = only(gate_files(tmp_path, [step_row()], [step_row(status="oom")]))
    assert point.outcome == "fail" and point.verdict == "ok → oom" and "out of memory" in point.reasons[0]
    assert only(gate_files(tmp_path, [step_row()], [step_row(status="error")])).verdict == "ok → error"
    fixed = only(gate_files(tmp_path, [step_row(status="oom")], [step_row()]))
    assert fixed.outcome == "pass" and fixed.verdict == "fixed (was oom)"
    still = only(gate_files(tmp_path, [step_row(status="oom")], [step_row(status="oom")]))
    assert still.outcome == "pass" and still.verdict == "oom → oom"
    # one failing repeat out of several is enough
    mixed = [step_row(repeat=0), step_row(repeat=1, status="oom")]
    assert only(gate_files(tmp_path, [step_row(repeat=0), step_row(repeat=1)], mixed)).verdict == "ok → oom"


def test_points_on_one_side_only_warn(tmp_path):
    base = [step_row("sdpa"), step_row("flex")]
    cand = [step_row("sdpa"), step_row("eager")]
    result = gate_files(tmp_path, base, cand)
    assert result.exit_code == 0 and not result.failed
    assert {p.label.split()[-1]: p.verdict for p in result.warned} == {
        "flex": "missing in candidate", "eager": "missing in baseline"}
    assert "warning: 2 missing or skipped on one side" in result.summary()


def test_repeats_compare_the_median_of_per_run_p50(tmp_path):
    base = [step_row(repeat=r, p50=100.0) for r in range(3)]
    cand = [step_row(repeat=r, p50=p) for r, p in enumerate([100.0, 130.0, 104.0])]
    point = only(gate_files(tmp_path, base, cand, noise="off"))
    assert point.candidate.repeats == 3 and point.candidate.step_ms_p50 == pytest.approx(104.0)
    assert point.ratio == pytest.approx(1.04) and point.outcome == "pass"  # the mean (111.3) would fail
    assert point.candidate.repeat_spread == pytest.approx(0.30)
    auto = only(gate_files(tmp_path, base, cand))
    assert auto.allowed_slowdown == pytest.approx(0.30) and auto.bound == "noise: cand repeats"
    # a repeat count that differs between the sides still pairs
    assert only(gate_files(tmp_path, base, [step_row(p50=101.0)])).outcome == "pass"


def test_points_pair_on_switches_and_experiment_not_point_id(tmp_path):
    other = step_row(switches={"attn_implementation": "sdpa", "gradient_checkpointing": False})
    result = gate_files(tmp_path, [step_row()], [step_row(point_id="renamed"), other])
    assert [p.verdict for p in result.points] == ["ok", "missing in baseline"]
    assert result.points[0].label != result.points[1].label  # same model/length/variant, told apart
    with pytest.raises(gate.GateError, match="no point of .* matches one of"):
        gate_files(tmp_path, [step_row()], [step_row(experiment="other")])


def test_different_gpu_is_refused_unless_allowed(tmp_path):
    base, cand = [step_row(device=H100)], [step_row(device="NVIDIA H200", p50=80.0)]
    with pytest.raises(gate.GateError, match=r"different GPUs: .* ran on NVIDIA H100 80GB HBM3, .* on NVIDIA H200"):
        gate_files(tmp_path, base, cand)
    result = gate_files(tmp_path, base, cand, allow_different_gpu=True)
    assert only(result).verdict == "faster" and only(result).device_name is None


def test_bad_input_is_one_error_naming_the_file(tmp_path):
    good = write(tmp_path / "good.jsonl", [step_row()])
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(json.dumps(step_row()) + "\n{not json\n")
    with pytest.raises(gate.GateError, match=r"corrupt.jsonl:2: not a whole result row"):
        gate.run(good, corrupt)
    with pytest.raises(gate.GateError, match=r"missing.jsonl: file not found"):
        gate.run(tmp_path / "missing.jsonl", good)
    bw_only = write(tmp_path / "bw.jsonl", [{"kind": "bandwidth", "status": "ok", "device_name": H100}])
    with pytest.raises(gate.GateError, match=r"bw.jsonl: no step rows"):
        gate.run(good, bw_only)
    (tmp_path / "empty").mkdir()
    with pytest.raises(gate.GateError, match=r"empty: no .jsonl result files"):
        gate.run(tmp_path / "empty", good)
    no_p50 = write(tmp_path / "nop50.jsonl", [step_row(step_ms={"p50": None})])
    with pytest.raises(gate.GateError, match=r"nop50.jsonl: row 1: ok row without a positive step_ms.p50"):
        gate.run(good, no_p50)
    twice = write(tmp_path / "dup" / "b.jsonl", [step_row()])
    write(tmp_path / "dup" / "a.jsonl", [step_row()])
    with pytest.raises(gate.GateError, match=r"repeat 0 of .* appears twice"):
        gate.run(good, twice.parent)


def test_parse_fraction():
    assert gate.parse_fraction("5%") == pytest.approx(0.05) and gate.parse_fraction("0.05") == 0.05
    assert gate.parse_fraction("12.5%") == pytest.approx(0.125)
    for bad in ("5", "fast", "-1%"):
        with pytest.raises(ValueError):
            gate.parse_fraction(bad)


def test_cli_exit_codes_table_and_json(tmp_path, capsys):
    base = write(tmp_path / "baseline.jsonl", [step_row("sdpa"), step_row("flex", p50=80.0)])
    ok = write(tmp_path / "ok" / "nvidia-h100.jsonl", [step_row("sdpa", p50=101.0), step_row("flex", p50=80.0)])
    slow = write(tmp_path / "slow" / "nvidia-h100.jsonl", [step_row("sdpa", p50=120.0), step_row("flex", status="oom")])
    out_json = tmp_path / "artifacts" / "gate.json"

    assert main(["gate", "--baseline", str(base), "--candidate", str(ok.parent), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "point" in out and "allowed" in out and "gate: PASS" in out.splitlines()[-1]
    assert json.loads(out_json.read_text())["outcome"] == "pass"

    assert main(["gate", "--baseline", str(base), "--candidate", str(slow), "--json", str(out_json),
                 "--max-slowdown", "25%"]) == 1
    out = capsys.readouterr().out
    assert "FAIL ok → oom" in out and "gate: FAIL: 1 of 2 points regressed" in out
    payload = json.loads(out_json.read_text())
    assert payload["exit_code"] == 1 and payload["max_slowdown"] == pytest.approx(0.25)
    assert [p["outcome"] for p in payload["points"]] == ["pass", "fail"]
    assert payload["points"][0]["baseline"]["step_ms_p50"] == 100.0

    assert main(["gate", "--baseline", str(base), "--candidate", str(slow), "--noise", "off"]) == 1
    assert "FAIL SLOWER" in capsys.readouterr().out

    assert main(["gate", "--baseline", str(tmp_path / "nope.jsonl"), "--candidate", str(ok), "--json", str(out_json)]) == 2
    assert "nope.jsonl: file not found" in capsys.readouterr().err
    assert json.loads(out_json.read_text())["exit_code"] == 2
    with pytest.raises(SystemExit) as e:
        main(["gate", "--baseline", str(base), "--candidate", str(ok), "--max-slowdown", "5"])
    assert e.value.code == 2 and "ambiguous" in capsys.readouterr().err


def test_cli_as_a_subprocess(tmp_path):
    base = write(tmp_path / "baseline.jsonl", [step_row()])
    cand = write(tmp_path / "candidate.jsonl", [step_row(p50=150.0)])
    proc = subprocess.run([sys.executable, "-m", "harness", "gate", "--baseline", str(base), "--candidate", str(cand)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "gate: FAIL" in proc.stdout
