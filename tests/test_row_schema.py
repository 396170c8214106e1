"""Row is the schema: the identity is read from its fields, the schema table in docs/harness.md is
generated from it, and every field of every committed step row is in it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness import row

ROOT = Path(__file__).resolve().parents[1]


def _committed_steps():
    for path in sorted((ROOT / "results").glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "step":
                yield path, r


def test_identity_read_from_row_keeps_every_committed_point_id():
    # the fields in the identity, in the order they always had: a change here renames every point
    assert row.IDENTITY == ("experiment", "model", "seq_len", "batch_size", "variant", "switches", "gpus",
                            "warmup_steps", "measured_steps", "lora_rank", "lora_dtype", "dtype", "device",
                            "data", "pin_cpu", "loss_mode", "cuda_graph")
    assert row.OPTIONAL_IDENTITY == ("stack", "parallel", "collector", "env_switches")
    rows = list(_committed_steps())
    assert len(rows) > 100
    wrong = [(p.name, r["point_id"]) for p, r in rows if row.point_id(r) != r["point_id"]]
    assert not wrong, wrong[:5]


def test_every_committed_step_row_field_is_in_the_schema():
    known = {f.name for f in dataclasses.fields(row.Row)} | set(row.MEASURED) | set(row.STAMPED) | set(row.RETIRED)
    unknown = {k: f"{p.parent.name}/{p.name}" for p, r in _committed_steps() for k in r if k not in known}
    assert not unknown, f"fields no schema entry explains (harness.row): {unknown}"
    assert {r["status"] for _, r in _committed_steps()} <= set(row.STATUSES)


def test_the_schema_table_in_the_docs_is_generated_from_row():
    doc = (ROOT / "docs" / "harness.md").read_text()
    table = doc.split("<!-- row-schema: generated -->\n", 1)[1].split("\n<!-- /row-schema -->", 1)[0]
    assert table == row.schema_markdown(), "regenerate the table from harness.row.schema_markdown()"
    for f in dataclasses.fields(row.Row):
        assert f.metadata.get("doc"), f"Row.{f.name} has no doc"


def test_what_each_optim_module_reports_after_a_step_is_a_row_field():
    import torch

    import optim
    from harness.run import record
    from harness.workload import models

    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4)
    optim.enable(model, offload="single", compile_layers=True)
    meta = optim.packing.PackedMetadata.from_lengths([[5, 11]])
    ids = torch.randint(0, 100, (1, 16))
    optim.packing.reset_counters()
    model(input_ids=ids, labels=ids, use_cache=False, **optim.packing.packed_kwargs(meta)).loss.backward()
    stats = record.optim_stats(model, optim.enabled(model))
    assert {"offload_stats", "packing_counters", "compile_stats", "attention_kernels"} <= set(stats), sorted(stats)
    assert stats["packing_counters"]["metadata"] == 1 and stats["offload_stats"] is not None
    fields = {f.name for f in dataclasses.fields(row.Row)} | set(row.MEASURED)
    assert set(stats) <= fields, sorted(set(stats) - fields)


def test_a_point_and_a_row_share_the_point_fields_declared_once():
    """SweepPoint is what a point's process gets; Row what it writes. Both extend row.Point, so a
    point field is declared once; new_row copies them all, and the run policy stays out of the row."""
    from harness.run.experiment import DataSpec, SweepPoint

    point = {f.name: f.type for f in dataclasses.fields(SweepPoint)}
    written = {f.name: f.type for f in dataclasses.fields(row.Row)}
    shared = {f.name for f in dataclasses.fields(row.Point)}
    run_policy = {"launcher", "timeout_s"}  # how the point is run, not what it records
    outcome = {"family", "num_layers", "status", "message", "kind", "measured"}  # what the run finds
    assert set(point) == shared | run_policy and set(written) == shared | outcome
    assert set(row.IDENTITY) | set(row.OPTIONAL_IDENTITY) <= shared
    assert point["data"] == "DataSpec" and written["data"] == "dict"  # the row keeps the spec as a plain dict
    p = SweepPoint(experiment="e", model="qwen3-0.6b-tiny", seq_len=64, batch_size=1, variant="v",
                   switches={"packing_cache": True}, gpus=1, repeat=0, warmup_steps=1, measured_steps=2,
                   lora_rank=8, lora_dtype="fp32", dtype="fp32", device="cpu", data=DataSpec(), stack="user", role="user",
                   env_switches={"OPTIM_VALIDATE": "0"}, timeout_s=5.0)
    r = p.new_row()
    assert {k: getattr(r, k) for k in shared - {"data"}} == {k: getattr(p, k) for k in shared - {"data"}}
    assert r.data == dataclasses.asdict(p.data) and r.point_id == p.point_id
    assert "timeout_s" not in r.to_dict() and r.to_dict()["status"] == "error"
    failed = r.outcome("oom", "out of memory")
    assert (failed.status, failed.message, failed.point_id) == ("oom", "out of memory", p.point_id)
