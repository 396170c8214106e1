"""One definition of a sweep point's identity and of the row that records it.

A point's identity is what it measures: the fields in ``IDENTITY``. The run policy (launcher,
time limit), the comparison context (baseline variant, role) and the provenance (command,
experiment file hash) are not in it, by construction: ``identity`` picks these fields and
nothing else. The sweep's resume (``point_id``), the gate's matching (``match_key``) and the
report's frames all read it from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

# What builds the model around the variant's switches (harness.run.peers): "" the harness's own
# stock build with just the optim modules the variant configures; "user" optim.enable(model) with
# its defaults, as a user calls it; "liger" Liger-Kernel's patches on the stock model; "compiled"
# the stock model with every decoder layer torch.compile'd; "unsloth" Unsloth's loader, LoRA and
# checkpointing (harness.run.unsloth_stack).
STACKS = ("user", "liger", "compiled", "unsloth")
# How a point spreads over its GPUs (``gpus``): "" one process, "fsdp2" one process per GPU with
# the model sharded (harness.run.distributed).
PARALLEL = ("", "fsdp2")
# Python's cycle collector in a point's measured steps: "" the harness's protocol (collected, frozen
# and disabled: no pause in the timed region, for every stack alike); "as_run" as the stack leaves
# it, so the step pays what it pays in a user's own loop (optim.enable raises its young threshold).
COLLECTORS = ("", "as_run")
STATUSES = ("ok", "oom", "error", "skipped")  # skipped: a peer that cannot run on that machine


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


def _field(default: Any = dataclasses.MISSING, *, doc: str, identity: str = "", factory=None):
    """A Row field: its meaning (the schema doc is generated from it) and its part in the
    point's identity ("always", "when set", or "" for none)."""
    meta = {"doc": doc, "identity": identity}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Point:
    """A sweep point as the row records it: its identity, its comparison context and its
    provenance. ``harness.run.experiment.SweepPoint`` (what a point's process gets) and ``Row``
    (what it writes) both extend it, so a point field is declared once, here."""

    experiment: str = _field(doc="the experiment's name", identity="always")
    model: str = _field(doc="the model (harness.workload.models)", identity="always")
    seq_len: int = _field(doc="tokens per packed row", identity="always")
    batch_size: int = _field(doc="rows per step", identity="always")
    variant: str = _field(doc="the experiment file's variant", identity="always")
    switches: dict = _field(doc="the variant's switches as the file sets them", identity="always")
    gpus: int = _field(doc="GPUs the point runs on", identity="always")
    repeat: int = _field(doc="which repeat of the point (in point_id, not in the gate's match)")
    warmup_steps: int = _field(doc="untimed steps before the measured ones", identity="always")
    measured_steps: int = _field(doc="timed steps", identity="always")
    lora_rank: int = _field(doc="LoRA rank", identity="always")
    lora_dtype: str = _field(doc="the adapters' dtype: fp32 (peft's default) or the model's", identity="always")
    dtype: str = _field(doc="the model's dtype", identity="always")
    device: str = _field(doc="auto, cuda or cpu", identity="always")
    data: dict = _field(doc="the packed data's distribution (harness.run.experiment.DataSpec)", identity="always")
    pin_cpu: bool = _field(False, doc="the point's process pinned to a NUMA-local CPU set", identity="always")
    loss_mode: str = _field("full", doc="full or chunked loss", identity="always")
    cuda_graph: bool = _field(False, doc="the measured steps were CUDA-graph replays (optim.graphs)",
                              identity="always")
    stack: str = _field("", doc="what builds the model: \"\" the harness, \"user\" optim.enable(model), "
                                "\"liger\" Liger-Kernel, \"compiled\" stock with compiled layers, \"unsloth\" Unsloth (STACKS)",
                        identity="when set")
    parallel: str = _field("", doc="\"\" one process, \"fsdp2\" one per GPU, the model sharded (PARALLEL)",
                           identity="when set")
    collector: str = _field("", doc="Python's cycle collector in the measured steps: \"\" collected, frozen and "
                                    "disabled (the harness's protocol); \"as_run\" as the stack leaves it, as "
                                    "the user's own loop runs it (COLLECTORS)", identity="when set")
    env_switches: dict = _field(doc="the OPTIM_<NAME> variables set where the sweep ran, as set: they fill "
                                    "the switches the variant leaves out", identity="when set", factory=dict)
    baseline_variant: str = _field("", doc="the variant the report compares against")
    role: str = _field("", doc="the variant's part in a comparison (harness.roles.ROLES)")
    command: str = _field("", doc="the command line that ran the sweep")
    experiment_sha256: str = _field("", doc="the experiment file's hash; the file is kept as "
                                            "<experiment>/experiments/<sha[:16]>.toml")


@dataclass(frozen=True)
class Row(Point):
    """A ``step`` row: the point (``Point``), the outcome, and (when ok) the measurements, which
    ``to_dict`` flattens in. Failure rows have every field but the measurements, whichever process
    wrote them. This class is the schema: ``IDENTITY`` and the table in docs/harness.md
    (``schema_markdown``) are read from its fields."""

    family: str = _field("", doc="the model's architecture family")
    num_layers: int | None = _field(None, doc="decoder layers")
    status: str = _field("error", doc="ok, oom, error or skipped (STATUSES)")
    message: str = _field("", doc="why it is not ok; empty when ok")
    kind: str = _field("step", doc="step")
    measured: dict = _field(doc="the measurements (MEASURED), flattened into the row when ok", factory=dict)

    def outcome(self, status: str, message: str = "") -> "Row":
        """This row with its status and message (the measurements stay, a dict filled in place)."""
        return dataclasses.replace(self, status=status, message=message)

    @property
    def point_id(self) -> str:
        return point_id(asdict(self))

    def to_dict(self) -> dict:
        out = asdict(self)
        measured = out.pop("measured")
        out["point_id"] = self.point_id
        return {**out, **measured}


# A point's identity: what it measures, read from Row. The fields "when set" entered the identity
# only when set, so adding them left every earlier point's id as it was.
IDENTITY = tuple(f.name for f in dataclasses.fields(Row) if f.metadata["identity"] == "always")
OPTIONAL_IDENTITY = tuple(f.name for f in dataclasses.fields(Row) if f.metadata["identity"] == "when set")

# What an ok step row measured (``Row.measured``, flattened into the row). Stats are
# {"p20", "p50", "p80", "samples": [...]} over the measured steps.
MEASURED = {
    "forward_ms": "forward time, stats (CUDA events on GPU, perf_counter on CPU)",
    "backward_ms": "backward time, stats",
    "optimizer_ms": "optimizer step time, stats",
    "step_ms": "the whole step, stats",
    "steps_per_s": "steps per second",
    "tokens_per_s": "tokens per second (a parallel point's: the whole group's)",
    "loss": "the loss of each measured step",
    "warmup_losses": "the loss of each warm-up step, the first included",
    "peak_allocated_gib": "peak allocated device memory (a parallel point's: the largest rank's)",
    "peak_reserved_gib": "peak reserved device memory",
    "peak_scope": "what the peak covers: \"measured steps\", or \"capture and replays\" when graphed",
    "nvml_device_used_gib": "the device's used memory from NVML (None on CPU)",
    "nvml_process_gib": "the process's device memory from NVML (None on CPU)",
    "flops_per_step": "the step's FLOPs",
    "model_flops_per_step": "the model's FLOPs (forward and backward, no recompute)",
    "hardware_flops_per_step": "the FLOPs executed, recompute included",
    "mfu": "model FLOPs utilization (None with mfu_note when the peak is unknown)",
    "hfu": "hardware FLOPs utilization",
    "flops_version": "the FLOP count's version (harness.measure.flops.FLOPS_VERSION; reports show no hfu of an older one)",
    "mfu_note": "why mfu is None",
    "num_docs": "documents per measured batch",
    "sum_len": "tokens per measured batch",
    "sum_len_sq": "the sum of squared document lengths per measured batch",
    "trainable_params": "trainable parameters",
    "total_params": "all parameters",
    "wall_s": "the point's wall time",
    "graph_capture_ms": "CUDA-graph capture time (None unless graphed)",
    "compiled_graphs_warmup": "graphs torch.compile made before the measured steps",
    "compiled_graphs_per_step": "graphs torch.compile made in each measured step (a step that compiled "
                                "was timed with its compile)",
    "attention_kernels": "{kernel: calls or None}: the attention kernels that ran (harness.run.record)",
    "attention_fallback": "why optim.packing's fused flex could not run, or None",
    "optim": "per optim module applied: what it did, read after the run (its counters over every step run in Python, warm-up included; with cuda_graph, the warm-up and the capture), and resolved, the value each of its switches took",
    "switches_resolved": "the value each switch took, flat",
    "setup_s": "where the point's wall time went: wait, build, enable, shard, warmup, capture, measured (s)",
    "launched_s": "the sweep process's age when it launched the point",
    "world_size": "a parallel point's ranks",
    "per_rank": "a parallel point's per-rank step, phase p50s, peak memory, losses and collective_ms",
    "tokens_per_s_per_gpu": "a parallel point's tokens/s per GPU",
    "loss_global": "a parallel point's loss of each global batch over the ranks",
    "loss_global_warmup": "the same for the warm-up steps",
    "scaling_efficiency": "on more than one GPU: its tokens/s per GPU over the same point's on one GPU",
    "node": "the host that ran it (--cluster ray)",
    "lane": "the lane of `--devices` that ran it (its CUDA_VISIBLE_DEVICES)",
    "device_type": "cuda or cpu: where the point ran",
    "dtype_used": "the dtype the model ran in",
    "attn_implementation_used": "the model's attention implementation as it ran",
    "pinned_core": "the CPU the point's process was pinned to (None unless pin_cpu)",
    "peak_flops": "the GPU's dense peak FLOP/s that mfu and hfu divide by",
    "offload_stats": "optim.offload's statistics (None where offload is off)",
    "packing_counters": "optim.packing's counters: builds, cache hits, host syncs",
    "compile_stats": "optim.regional's compiled layers and failures",
    "traceback": "an error row's Python traceback (its last 4,000 characters)",
    "log_tail": "a row of a point whose process died without a result: the end of its log",
    "memory_bound": "an oom row's memory that ran out where not the GPU's: host (the kernel's OOM killer ended the point)",
    "host_used_peak_gib": "the host's memory in use (MemTotal - MemAvailable, every process's) at its peak while the point ran, sampled by the sweep process (harness.measure.host)",
    "recompute_stats": "optim.recompute's decisions: layers that skipped their recompute, what the first step measured",
    "mlp_stats": "optim.mlp's chunked MLPs and how many of their calls ran in chunks",
    "gc_collections": "Python's cycle collections over the measured steps, by generation (gc.get_stats)",
    "norm_stats": "optim.norm's chunked final norms, the norms it left alone, and how many calls ran in chunks",
}
# Fields of earlier rows, kept readable: no code writes them now.
RETIRED = {
    "peak_allocated_note": "why a row's peak was not measured (now peak_scope says what a peak covers)",
}
# What the results file adds to every row it writes (harness.results).
STAMPED = {
    "schema": "the row format's version",
    "point_id": "a digest of the identity and the repeat: what a sweep resumes on",
    "gpu_slug": "the GPU type, as a file name",
    "device_name": "the GPU's (or cpu's) name",
    "env": "the environment (harness.measure.env)",
    "recorded_at": "ISO-8601 UTC time the row was written",
}


def schema_markdown() -> str:
    """The step row's fields as a Markdown table, from ``Row``, ``MEASURED`` and ``STAMPED``."""
    lines = ["| field | in the identity | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Row):
        if f.name != "measured":
            lines.append(f"| `{f.name}` | {f.metadata['identity'] or '–'} | {f.metadata['doc']} |")
    lines += [f"| `{k}` | – | {v} |" for k, v in STAMPED.items()]
    lines += [f"| `{k}` | – | measured: {v} |" for k, v in MEASURED.items()]
    lines += [f"| `{k}` | – | earlier rows only: {v} |" for k, v in RETIRED.items()]
    return "\n".join(lines)
