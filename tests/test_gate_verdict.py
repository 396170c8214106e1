"""The revisions gate's verdict on synthetic rounds: what it must not let through. A point head
stopped measuring, a base round that failed once, a side without a memory reading and rows whose
identity changed between the two codes each fail, are judged anyway, or stop the gate; none
passes unseen."""

from __future__ import annotations

import pytest

from harness.gate import verdict
from harness.gate.files import GateError
from harness.run.gate_spec import GateSpec

SPEC = GateSpec(rounds=5)


def _rows(side: str, ms: list[float], *, variant="user", peak=None, status=None, data=None):
    rows = []
    for i, m in enumerate(ms, 1):
        r = {"kind": "step", "model": "m", "seq_len": 64, "variant": variant, "batch_size": 1, "lora_rank": 4,
             "dtype": "fp32", "data": data or {"median_doc_len": 12}, "status": (status or {}).get(i, "ok"),
             "_round": i, "_side": side}
        if r["status"] == "ok":
            r["step_ms"] = {"p50": m}
            if peak is not None and (p := peak[i - 1]) is not None:
                r["peak_allocated_gib"] = p
        else:
            r["message"] = "CUDA out of memory" if r["status"] == "oom" else "boom"
        rows.append(r)
    return rows


def _one(base, head):
    points, _ = verdict.judge(base, head, SPEC, [])
    (p,) = [p for p in points if p.variant == "user"]
    return p


def test_a_point_head_no_longer_measures_fails():
    base = _rows("base", [100] * 5) + _rows("base", [50] * 5, variant="other")
    head = _rows("head", [50] * 5, variant="other")
    p = _one(base, head)
    assert (p.outcome, p.verdict) == ("fail", "missing in head") and "no row of it" in p.reasons[0]


def test_rows_whose_identity_changed_stop_the_gate():
    base = _rows("base", [100] * 5)
    head = _rows("head", [150] * 5, data={"median_doc_len": 12, "new_field": 0})
    with pytest.raises(GateError, match="none of head's 1 points matches one of base's 1"):
        verdict.judge(base, head, SPEC, [])


def test_one_failed_base_round_does_not_exempt_a_slowdown():
    base = _rows("base", [100] * 5, status={3: "error"})
    p = _one(base, _rows("head", [150] * 5))
    assert p.outcome == "fail" and p.verdict.startswith("SLOWER") and "base error in 1 of 5 rounds" in p.verdict
    same = _one(base, _rows("head", [100] * 5))
    assert same.outcome == "warn" and "judged on the other 4" in same.verdict  # passes, and says why it is a warning
    mostly = _rows("base", [100] * 5, status={1: "oom", 2: "oom", 3: "oom"})
    assert _one(mostly, _rows("head", [150] * 5)).verdict == "fixed (was oom)"  # base broken: head fixed it
    head_flaky = _one(_rows("base", [100] * 5), _rows("head", [100] * 5, status={2: "error"}))
    assert (head_flaky.outcome, head_flaky.verdict) == ("fail", "ok -> error")  # head's failure still fails


def test_memory_is_judged_on_the_rounds_that_read_it_and_a_side_without_any_says_so():
    base = _rows("base", [100] * 5, peak=[10.0] * 5)
    grew = _one(base, _rows("head", [100] * 5, peak=[12.0, 12.0, None, 12.0, 12.0]))
    assert grew.outcome == "fail" and grew.verdict == "MEMORY" and grew.memory.estimate == pytest.approx(2048)
    blind = _one(base, _rows("head", [100] * 5))
    assert blind.outcome == "warn" and "memory not judged: head recorded no peak" in blind.verdict
