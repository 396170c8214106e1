"""A row of optim.enable() measured under a default that has changed since says so: in the README's
headline (beside its commit) and in the user report (a line under the columns)."""

from harness.report import cite, defaults, headline
from harness.report.runs import other_code
from harness.report.user import user_md
from optim.switches import DECLARED

NOW = {name: sw.default for module in DECLARED.values() for name, sw in module.items()}


def _other(name):
    """A valid value of switch ``name`` other than its default now."""
    sw = next(m[name] for m in DECLARED.values() if name in m)
    return next(c for c in sw.choices if c != sw.default)


def test_only_a_switch_left_to_its_default_that_differs_now_is_named():
    then = _other("moe_saved")
    ran = {**NOW, "moe_saved": then}
    assert defaults.changed({"switches_resolved": ran}) == {"moe_saved": (then, NOW["moe_saved"])}
    assert defaults.note({"switches_resolved": ran}) == f"moe_saved={then}, {NOW['moe_saved']} now"
    # the variant set it, or an OPTIM_* variable did: a setting of the row, not a default
    assert defaults.changed({"switches_resolved": ran, "switches": {"moe_saved": then}}) == {}
    assert defaults.changed({"switches_resolved": ran, "env_switches": {"OPTIM_MOE_SAVED": str(then)}}) == {}
    # today's defaults, a switch since removed, a peer's row (no optim switches), no row
    assert defaults.changed({"switches_resolved": {**NOW, "a_switch_gone": 1}}) == {}
    assert defaults.changed({"switches_resolved": {}}) == {} and defaults.changed(None) == {}
    two = {**ran, "recompute": _other("recompute")}
    assert list(defaults.changed({"switches_resolved": two})) == ["moe_saved", "recompute"]


def _row(variant, ms, resolved=None):
    r = {"kind": "step", "variant": variant, "role": variant, "point_id": f"p-{variant}", "status": "ok", "model": "gpt-oss-20b",
         "seq_len": 2048, "lora_rank": 64, "experiment": "user-moe", "gpu_slug": "nvidia-h200",
         "device_name": "NVIDIA H200", "env": {"git_sha": "abcdef0123", "git_dirty": False},
         "recorded_at": "2026-11-23T17:40:00+00:00", "step_ms": {"p20": ms - 1, "p50": ms, "p80": ms + 1},
         "peak_allocated_gib": 50.0}
    if resolved is not None:
        r["switches_resolved"] = resolved
    return r


def _headline(user_resolved):
    from harness.report.blog.data import RolePoint

    p = RolePoint(gpu="nvidia-h200", device="NVIDIA H200", model="gpt-oss-20b", seq_len=2048)
    p.rows = {"stock": _row("stock", 540.0), "user": _row("user", 150.0, user_resolved)}
    head, _, row = headline._table(cite.Figures(), [p], other_code(list(p.rows.values()))).splitlines()
    return dict(zip(head.strip("|").split(" | "), row.strip("|").split(" | ")))["commit"].strip()


def test_the_headline_names_the_old_default_beside_the_commit():
    then = _other("moe_saved")
    assert _headline({**NOW, "moe_saved": then}) == f"`abcdef0` (moe_saved={then}, {NOW['moe_saved']} now)"
    assert _headline(dict(NOW)) == "`abcdef0`"


def test_the_user_report_says_which_point_ran_an_old_default():
    then = _other("moe_saved")
    rows = [_row("stock", 540.0), _row("user", 150.0, {**NOW, "moe_saved": then})]
    text = user_md(rows, {})
    assert f"gpt-oss-20b at 2048 tokens (nvidia-h200): moe_saved={then}, {NOW['moe_saved']} now" in text
    rows[1]["switches_resolved"] = dict(NOW)
    assert "the old default" not in user_md(rows, {})
    # an ablation of the same run that ran the old default is marked in its own table
    rows.append({**_row("user-varlen", 160.0, {**NOW, "moe_saved": then}), "role": "ablation"})
    text = user_md(rows, {})
    assert f"| user-varlen (moe_saved={then}, {NOW['moe_saved']} now) |" in text and "the old default" in text
    assert "The user's path ran so" not in text
