"""One identity for a point, used by resume, gate and report alike."""

from __future__ import annotations

import dataclasses

import pytest

from harness import gate
from harness import row as rowmod
from harness.run import experiment

EXP = """
[experiment]
name = "ident"
models = ["llama-3.2-1b-tiny"]
seq_lens = [32]
device = "cpu"
[variants.a]
role = "stock"
attn_implementation = "sdpa"
"""


def _point(write_toml, text=EXP):
    (p,) = experiment.load(write_toml(text)).points()
    return p


def test_run_policy_context_and_provenance_are_not_identity(write_toml):
    p = _point(write_toml)
    for change in ({"launcher": "preloaded"}, {"timeout_s": 5.0}, {"baseline_variant": "x"},
                   {"role": "ours"}, {"command": "python -m harness sweep x"}, {"experiment_sha256": "f" * 64}):
        assert dataclasses.replace(p, **change).point_id == p.point_id, change
    assert dataclasses.replace(p, repeat=1).point_id != p.point_id


@pytest.mark.parametrize("field, value", [("loss_mode", "chunked"), ("lora_dtype", "model"),
                                          ("cuda_graph", True), ("pin_cpu", True), ("device", "cuda")])
def test_every_measured_difference_is_a_different_point(write_toml, field, value):
    p = _point(write_toml)
    q = dataclasses.replace(p, **{field: value})
    assert q.point_id != p.point_id
    a, b = p.new_row().to_dict(), q.new_row().to_dict()
    assert gate.identity(a) != gate.identity(b)  # the gate no longer pairs them as one


def test_the_data_spec_is_identity(write_toml):
    p = _point(write_toml)
    q = _point(write_toml, EXP.replace('device = "cpu"', 'device = "cpu"\n[data]\nmedian_doc_len = 7', 1))
    assert q.point_id != p.point_id and gate.identity(p.new_row().to_dict()) != gate.identity(q.new_row().to_dict())


def test_row_and_point_agree_on_the_id(write_toml):
    p = _point(write_toml)
    r = p.new_row().to_dict()
    assert r["point_id"] == p.point_id == rowmod.point_id(r)
    assert r["role"] == "stock" and r["family"] == "llama" and r["status"] == "error"


def test_role_must_be_known(write_toml):
    with pytest.raises(experiment.ExperimentError,
                       match=r"variants.a.role.*valid: stock, stock-compiled, peer, unsloth, user, ours, reference, ablation\)"):
        experiment.load(write_toml(EXP.replace('role = "stock"', 'role = "mine"')))
