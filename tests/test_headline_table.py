"""The README headline table's ratio cell: against the fastest peer that ran, and saying how many
of the peers ran where some did not (a point measured beside stock and Liger alone cannot claim
its ratio is against the fastest of all four)."""

from harness.report import cite, headline
from harness.report.blog.data import RolePoint


def _row(variant, ms, peak):
    return {"kind": "step", "variant": variant, "point_id": f"p-{variant}", "status": "ok", "model": "qwen3-8b", "seq_len": 8192,
            "lora_rank": 16, "experiment": "user", "gpu_slug": "nvidia-h200", "env": {"git_sha": "abcdef0123"},
            "recorded_at": "2026-11-23T17:40:00+00:00", "step_ms": {"p20": ms - 1, "p50": ms, "p80": ms + 1},
            "peak_allocated_gib": peak}


def _point(**roles):
    p = RolePoint(gpu="nvidia-h200", device="NVIDIA H200", model="qwen3-8b", seq_len=8192)
    p.rows = {role: _row(role, ms, peak) for role, (ms, peak) in roles.items()}
    return p


def _ratio_cell(p):
    head, _, row = headline._table(cite.Figures(), [p]).splitlines()
    cells = dict(zip(head.strip("|").split(" | "), row.strip("|").split(" | ")))
    return cells["enable() against the fastest other"].strip()


def test_a_point_without_every_peer_says_how_many_ran():
    some = _point(stock=(1423.3, 32.1), peer=(1166.6, 20.55), user=(935.4, 20.87))
    cell = _ratio_cell(some)
    assert cell == "1.25× (Liger-Kernel, 2 of 4 peers run)", cell
    some.failed["unsloth"] = "oom"  # a peer that ran and failed counts as run: it could not be faster
    assert _ratio_cell(some) == "1.25× (Liger-Kernel, 3 of 4 peers run)"
    every = _point(stock=(1567.1, 32.1), **{"stock-compiled": (984.9, 32.1)}, peer=(1250.8, 20.55),
                   unsloth=(1133.0, 17.38), user=(569.0, 54.48))
    assert _ratio_cell(every) == "1.73× (stock + torch.compile)"
