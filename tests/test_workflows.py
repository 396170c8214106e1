"""The GPU workflow runs only code a maintainer chose: one labelled head at a time, never a later
push by itself."""

from pathlib import Path

import yaml

WORKFLOW = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "gpu-gate.yml"


def test_gpu_gate_runs_only_the_head_a_maintainer_labelled():
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as true
    assert set(on) == {"pull_request"} and on["pull_request"]["types"] == ["labeled"], on
    job = wf["jobs"]["gate"]
    assert job["if"].replace(" ", "") == "github.event.label.name=='gpu-gate'"
    assert "self-hosted" in job["runs-on"] and job.get("environment")
    steps = job["steps"]
    assert "--remove-label gpu-gate" in steps[0]["run"], steps[0]
    checkout = next(s for s in steps if s.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["ref"] == "${{ github.event.pull_request.head.sha }}"
