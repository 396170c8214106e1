"""The GPU workflow runs only code a maintainer chose: one labelled head at a time, never a later
push by itself, and never with a token that can write."""

from pathlib import Path

import yaml

WORKFLOW = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "gpu-gate.yml"


def test_gpu_gate_runs_only_the_head_a_maintainer_labelled():
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as true
    # the base branch's definition, started by the label alone (a push is `synchronize`)
    assert set(on) == {"pull_request_target"} and on["pull_request_target"]["types"] == ["labeled"], on
    assert wf["permissions"] == {}
    unlabel, gate = wf["jobs"]["unlabel"], wf["jobs"]["gate"]
    for job in (unlabel, gate):
        assert job["if"].replace(" ", "") == "github.event.label.name=='gpu-gate'"
    assert "self-hosted" not in unlabel["runs-on"] and "--remove-label gpu-gate" in unlabel["steps"][0]["run"]
    assert "self-hosted" in gate["runs-on"] and gate.get("environment")
    assert gate["permissions"] == {"contents": "read"}
    checkout = next(s for s in gate["steps"] if s.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["ref"] == "${{ github.event.pull_request.head.sha }}"
    assert checkout["with"]["persist-credentials"] is False
