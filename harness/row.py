"""One definition of a sweep point's identity and of the row that records it.

A point's identity is what it measures: the fields in ``IDENTITY``. The run policy (launcher,
time limit), the comparison context (baseline variant, role) and the provenance (command,
experiment file hash) are not in it, by construction: ``identity`` picks these fields and
nothing else. The sweep's resume (``point_id``), the gate's matching (``match_key``) and the
report's frames all read it from here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

# In a row and in a SweepPoint alike.
IDENTITY = ("experiment", "model", "seq_len", "batch_size", "variant", "switches", "gpus",
            "warmup_steps", "measured_steps", "lora_rank", "lora_dtype", "dtype", "device", "data",
            "pin_cpu", "loss_mode", "cuda_graph")
# In the identity only when set, so adding them left every earlier point's id as it was.
OPTIONAL_IDENTITY = ("stack", "parallel")
# What builds the model around the variant's switches (harness.run.peers): "" the harness's own
# stock build with just the optim modules the variant configures; "user" optim.enable(model) with
# its defaults, as a user calls it; "liger" Liger-Kernel's patches on the stock model.
STACKS = ("user", "liger")
# How a point spreads over its GPUs (``gpus``): "" one process, "fsdp2" one process per GPU with
# the model sharded (harness.run.distributed).
PARALLEL = ("", "fsdp2")
ROLES = ("stock", "peer", "ours", "ours-default", "reference", "ablation")
# stock: transformers + peft as shipped; peer: another tool users would pick instead (Liger-Kernel,
# save_on_cpu); ours: an optim setting; ours-default: what optim.enable(model) gives with its
# defaults; reference: the numerics or speed reference a comparison starts from; ablation: a
# step between them, kept to show what each part buys.


def identity(fields: dict[str, Any], *, repeat: bool = False) -> dict[str, Any]:
    """The identity fields of a row or a point (``repeat`` included on request)."""
    keys = (*IDENTITY, "repeat") if repeat else IDENTITY
    out = {k: fields.get(k) for k in keys}
    out.update({k: fields[k] for k in OPTIONAL_IDENTITY if fields.get(k)})
    return out


def _digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def point_id(fields: dict[str, Any]) -> str:
    """Stable id of one repeat of one point: the key a sweep resumes on."""
    return _digest(identity(fields, repeat=True))


def match_key(fields: dict[str, Any]) -> str:
    """What the gate pairs a baseline row with a candidate row on: the identity without the repeat."""
    return json.dumps(identity(fields), sort_keys=True, default=str)


@dataclass
class Row:
    """A ``step`` row: the point's identity, its context and provenance, the outcome, and (when
    ok) the measurements, which ``to_dict`` flattens in. Failure rows have every field but the
    measurements, whichever process wrote them."""

    experiment: str
    model: str
    seq_len: int
    batch_size: int
    variant: str
    switches: dict
    gpus: int
    repeat: int
    warmup_steps: int
    measured_steps: int
    lora_rank: int
    lora_dtype: str
    dtype: str
    device: str
    data: dict
    pin_cpu: bool
    loss_mode: str
    cuda_graph: bool
    stack: str = ""
    parallel: str = ""  # PARALLEL: "" one process, "fsdp2" one per GPU, the model sharded
    family: str = ""
    num_layers: int | None = None
    baseline_variant: str = ""
    role: str = ""
    command: str = ""
    experiment_sha256: str = ""
    status: str = "error"
    message: str = ""
    kind: str = "step"
    measured: dict = field(default_factory=dict)

    @property
    def point_id(self) -> str:
        return point_id(asdict(self))

    def to_dict(self) -> dict:
        out = asdict(self)
        measured = out.pop("measured")
        out["point_id"] = self.point_id
        return {**out, **measured}
