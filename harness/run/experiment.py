"""Experiment files (TOML) → a validated Experiment → a list of sweep points.

Everything that can be wrong with an experiment is found here, before anything runs, and
reported as one ``ExperimentError`` that names the file, the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import row as rowmod
from harness.roles import LEGACY, ROLES, STACK_ROLE, STACK_ROLES, role_of
from harness.run import fields
from harness.run.fields import ExperimentError, check_keys, choice, int_list, integer
from harness.run.gate_spec import GateSpec, parse_gate
from harness.run.policy import LAUNCHERS, MULTI_GPU_LAUNCHERS
from harness.run.report_spec import parse_report
from harness.variant_keys import OWNER, SWITCHES, resolve
from harness.workload import models as model_registry

MIN_WARMUP_STEPS = 3
MIN_MEASURED_STEPS = 10
DISTRIBUTIONS = ("lognormal", "fixed", "uniform")
DTYPES = ("bf16", "fp32")
DEVICES = ("auto", "cuda", "cpu")
LOSSES = ("full", "chunked")
LORA_DTYPES = model_registry.LORA_DTYPES


@dataclass(frozen=True)
class DataSpec:
    distribution: str = "lognormal"
    median_doc_len: int = 300
    sigma: float = 1.0
    min_doc_len: int = 1
    seed: int = 0


def env_switches() -> dict[str, str]:
    """The ``OPTIM_<NAME>`` variables of this environment that name an optim switch, as set: they
    fill every switch a variant leaves out (``optim.enable``), so they are part of what a point
    measures, and of its identity where any is set."""
    return {sw.env_var: os.environ[sw.env_var] for name, sw in SWITCHES.items()
            if name in OWNER and sw.env_var in os.environ}


@dataclass(frozen=True)
class SweepPoint(rowmod.Point):
    """One timed run. Everything a fresh process needs to run it, and nothing else: the point's
    fields (``harness.row.Point``, whose ``data`` it carries as the ``DataSpec``) and how it is
    run. Its identity is ``harness.row.IDENTITY``; the run policy, the comparison context
    (baseline variant, role) and the provenance (command, experiment hash) ride along outside it."""

    data: DataSpec
    # run policy
    launcher: str = "process"
    timeout_s: float = 900.0

    @property
    def point_id(self) -> str:
        """Stable identity for resume: what is measured, not how or why it is run."""
        return rowmod.point_id(asdict(self))

    def label(self) -> str:
        return f"{self.model} T={self.seq_len} bs={self.batch_size} {self.variant} r{self.repeat}"

    def new_row(self) -> rowmod.Row:
        """This point's row before it ran (status error until told otherwise)."""
        spec = model_registry.get(self.model)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(rowmod.Point)}
        fields["data"] = asdict(self.data)
        return rowmod.Row(**fields, family=spec.family, num_layers=spec.num_hidden_layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SweepPoint":
        raw = json.loads(text)
        raw["data"] = DataSpec(**raw["data"])
        return cls(**raw)


@dataclass(frozen=True)
class Experiment:
    name: str
    path: str
    description: str
    models: list[str]
    seq_lens: list[int]
    batch_size: int
    gpus: list[int]  # GPUs per point, swept: each count its own points
    variants: dict[str, dict[str, Any]]
    baseline_variant: str
    warmup_steps: int
    measured_steps: int
    repeats: int
    lora_rank: int
    dtype: str
    device: str
    launcher: str
    timeout_s: float
    bandwidth: bool
    collector: str = ""  # the measured steps' cycle collector (harness.row.COLLECTORS)
    data: DataSpec = field(default_factory=DataSpec)
    pin_cpu: bool = False
    loss: str = "full"
    variant_loss: dict[str, str] = field(default_factory=dict)  # per-variant override of ``loss``
    lora_dtype: str = "fp32"
    variant_lora_dtype: dict[str, str] = field(default_factory=dict)  # likewise for ``lora_dtype``
    variant_cuda_graph: dict[str, bool] = field(default_factory=dict)  # variants timed as graph replays
    variant_stack: dict[str, str] = field(default_factory=dict)  # variants built as a user or a peer would
    roles: dict[str, str] = field(default_factory=dict)  # variant -> its role (harness.roles.ROLES)
    report: dict[str, dict[str, Any]] = field(default_factory=dict)  # [report.<section>] tables
    sha256: str = ""  # of the experiment file's bytes
    text: str = ""  # the experiment file as read
    # package -> version specifier the sweep needs installed (what the rows claim to measure)
    requires: dict[str, str] = field(default_factory=dict)
    variant_models: dict[str, list[str]] = field(default_factory=dict)  # variants run on some models only
    variant_seq_lens: dict[str, list[int]] = field(default_factory=dict)  # ... and at some lengths only
    gate: GateSpec | None = None  # [gate]: this file is a regression-gate suite (harness.gate)
    parallel: str = ""  # "fsdp2": each point one process per GPU under torchrun, the model sharded

    def points(self) -> list[SweepPoint]:
        """Ordered so each model's points run together and variants are interleaved per length,
        which keeps side-by-side comparisons close in time."""
        out = []
        env = env_switches()
        for repeat in range(self.repeats):
            for model in self.models:
                for seq_len in self.seq_lens:
                    for gpus, (vname, settings) in itertools.product(self.gpus, self.variants.items()):
                        if model not in self.variant_models.get(vname, [model]):
                            continue
                        if seq_len not in self.variant_seq_lens.get(vname, [seq_len]):
                            continue
                        out.append(
                            SweepPoint(
                                experiment=self.name,
                                model=model,
                                seq_len=seq_len,
                                batch_size=self.batch_size,
                                variant=vname,
                                switches=resolve(settings),
                                gpus=gpus,
                                parallel=self.parallel,
                                env_switches=env,
                                repeat=repeat,
                                warmup_steps=self.warmup_steps,
                                measured_steps=self.measured_steps,
                                lora_rank=self.lora_rank,
                                dtype=self.dtype,
                                device=self.device,
                                data=self.data,
                                                # an Unsloth point imports Unsloth first in a fresh interpreter; the
                                # preloaded launcher's fork server has torch imported already
                                launcher=MULTI_GPU_LAUNCHERS[0] if self.parallel else
                                "process" if self.variant_stack.get(vname) == "unsloth" else self.launcher,
                                timeout_s=self.timeout_s,
                                baseline_variant=self.baseline_variant,
                                pin_cpu=self.pin_cpu,
                                collector=self.collector,
                                loss_mode=self.variant_loss.get(vname, self.loss),
                                lora_dtype=self.variant_lora_dtype.get(vname, self.lora_dtype),
                                cuda_graph=self.variant_cuda_graph.get(vname, False),
                                stack=self.variant_stack.get(vname, ""),
                                role=self.roles.get(vname, ""),
                                experiment_sha256=self.sha256,
                            )
                        )
        return out


_TOP_KEYS = {"experiment", "data", "variants", "report", "gate"}

_EXPERIMENT_KEYS = {
    "name", "description", "models", "seq_lens", "batch_size", "gpus", "warmup_steps",
    "measured_steps", "repeats", "lora_rank", "dtype", "device", "launcher", "timeout_s",
    "baseline", "bandwidth", "pin_cpu", "loss", "lora_dtype", "requires", "parallel", "collector",
}
_DATA_KEYS = {"distribution", "median_doc_len", "sigma", "min_doc_len", "seed"}


def load(path: str | Path) -> Experiment:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ExperimentError(path, "-", "file not found") from None
    except OSError as e:
        raise ExperimentError(path, "-", f"cannot read it ({e.strerror})") from None
    try:
        text = data.decode()
        raw = tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise ExperimentError(path, "-", f"not UTF-8 text ({e.reason})") from None
    except tomllib.TOMLDecodeError as e:
        raise ExperimentError(path, "-", f"not valid TOML: {e}") from None
    return dataclasses.replace(parse(raw, path), sha256=hashlib.sha256(data).hexdigest(), text=text)


def parse(raw: dict[str, Any], path: str | Path = "<memory>") -> Experiment:
    check_keys(path, "", raw, _TOP_KEYS)
    if "experiment" not in raw:
        raise ExperimentError(path, "experiment", "missing table")
    exp = raw["experiment"]
    check_keys(path, "experiment", exp, _EXPERIMENT_KEYS)
    for required in ("name", "models", "seq_lens"):
        if required not in exp:
            raise ExperimentError(path, f"experiment.{required}", "missing required key")

    name = fields.name(path, "experiment.name", exp["name"])

    models = exp["models"]
    if not isinstance(models, list) or not models:
        raise ExperimentError(path, "experiment.models", "must be a non-empty list of model names", model_registry.names())
    canon = []
    for i, m in enumerate(models):
        try:
            canon.append(model_registry.get(m).name)
        except KeyError:
            raise ExperimentError(path, f"experiment.models[{i}]", f"unknown model {m!r}", model_registry.names()) from None
    fields.no_repeats(path, "experiment.models", canon)  # names are case-insensitive: one model, listed twice

    seq_lens = int_list(path, "experiment.seq_lens", exp["seq_lens"], 16)
    batch_size = integer(path, "experiment.batch_size", exp.get("batch_size", 1), 1)
    raw_gpus = exp.get("gpus", 1)
    gpus = (int_list(path, "experiment.gpus", raw_gpus, 1) if isinstance(raw_gpus, list)
            else [integer(path, "experiment.gpus", raw_gpus, 1)])
    parallel = choice(path, "experiment.parallel", exp.get("parallel", "none"), ("none", *rowmod.PARALLEL[1:]))
    parallel = "" if parallel == "none" else parallel
    warmup = integer(path, "experiment.warmup_steps", exp.get("warmup_steps", MIN_WARMUP_STEPS), MIN_WARMUP_STEPS)
    measured = integer(path, "experiment.measured_steps", exp.get("measured_steps", MIN_MEASURED_STEPS), MIN_MEASURED_STEPS)
    repeats = integer(path, "experiment.repeats", exp.get("repeats", 1), 1)
    lora_rank = integer(path, "experiment.lora_rank", exp.get("lora_rank", 16), 1)
    dtype = choice(path, "experiment.dtype", exp.get("dtype", "bf16"), DTYPES)
    device = choice(path, "experiment.device", exp.get("device", "auto"), DEVICES)
    launcher = choice(path, "experiment.launcher", exp.get("launcher", "process"), LAUNCHERS)
    if max(gpus) > 1 and not parallel:
        raise ExperimentError(path, "experiment.parallel", f"{max(gpus)} GPUs per point shard the model over "
                              "one process per GPU: set parallel = \"fsdp2\"", list(rowmod.PARALLEL[1:]))
    timeout_s = exp.get("timeout_s", 900)  # finite: nan or inf would be no limit at all
    fields.positive_number(path, "experiment.timeout_s", timeout_s)
    pin_cpu = exp.get("pin_cpu", False)
    if not isinstance(pin_cpu, bool):
        raise ExperimentError(path, "experiment.pin_cpu", f"must be true or false, got {pin_cpu!r}")
    # full: the model's own loss (fp32 logits of the whole batch); chunked: harness.workload.loss, lm_head +
    # cross-entropy in checkpointed token chunks, so the logits do not set the peak
    loss = choice(path, "experiment.loss", exp.get("loss", "full"), LOSSES)
    # fp32: peft's default, adapter weights (and so their grads and AdamW states) upcast to
    # float32; model: adapters in the model's dtype (bf16 on GPU), half the trainable state
    lora_dtype = choice(path, "experiment.lora_dtype", exp.get("lora_dtype", "fp32"), LORA_DTYPES)
    # frozen: the harness's protocol; as_run: the collector as the stack leaves it (a user's loop)
    collector = {"frozen": "", "as_run": "as_run"}[
        choice(path, "experiment.collector", exp.get("collector", "frozen"), ("frozen", "as_run"))]
    bandwidth = exp.get("bandwidth", True)
    if not isinstance(bandwidth, bool):
        raise ExperimentError(path, "experiment.bandwidth", f"must be true or false, got {bandwidth!r}")

    requires = _requires(path, exp.get("requires", {}))

    # Impossible shapes: caught here rather than as a crash inside a point.
    for m in canon:
        spec = model_registry.get(m)
        if lora_rank > spec.hidden_size:
            raise ExperimentError(path, "experiment.lora_rank", f"rank {lora_rank} exceeds {m}'s hidden size {spec.hidden_size}")
        for t in seq_lens:
            if t > spec.max_position_embeddings:
                raise ExperimentError(path, "experiment.seq_lens", f"{t} exceeds {m}'s max_position_embeddings {spec.max_position_embeddings}")

    data_raw = raw.get("data", {})
    check_keys(path, "data", data_raw, _DATA_KEYS)
    data = DataSpec(
        distribution=choice(path, "data.distribution", data_raw.get("distribution", "lognormal"), DISTRIBUTIONS),
        median_doc_len=integer(path, "data.median_doc_len", data_raw.get("median_doc_len", 300), 1),
        sigma=fields.number_at_least(path, "data.sigma", data_raw.get("sigma", 1.0), 0),
        min_doc_len=integer(path, "data.min_doc_len", data_raw.get("min_doc_len", 1), 1),
        seed=integer(path, "data.seed", data_raw.get("seed", 0), 0),
    )
    if data.min_doc_len > min(seq_lens):
        raise ExperimentError(path, "data.min_doc_len", f"{data.min_doc_len} exceeds the shortest row ({min(seq_lens)} tokens)")

    variants_raw = raw.get("variants", {"default": {}})
    if not isinstance(variants_raw, dict) or not variants_raw:
        raise ExperimentError(path, "variants", "must hold at least one named table, e.g. [variants.stock]")
    variants: dict[str, dict[str, Any]] = {}
    variant_loss: dict[str, str] = {}
    variant_lora_dtype: dict[str, str] = {}
    variant_cuda_graph: dict[str, bool] = {}
    variant_stack: dict[str, str] = {}
    variant_models: dict[str, list[str]] = {}
    variant_seq_lens: dict[str, list[int]] = {}
    roles: dict[str, str] = {}
    for vname, settings in variants_raw.items():
        check_keys(path, f"variants.{vname}", settings,
                    set(SWITCHES) | {"loss", "lora_dtype", "cuda_graph", "role", "stack", "models", "seq_lens"})
        settings = dict(settings)
        if "models" in settings:  # this variant runs on these of the file's models only
            variant_models[vname] = _variant_models(path, vname, settings.pop("models"), canon)
        if "seq_lens" in settings:  # ... and at these of its lengths only
            variant_seq_lens[vname] = _variant_seq_lens(path, vname, settings.pop("seq_lens"), seq_lens)
        implied, declared = "", ""  # the stack a role implies where the file names none; the role as written
        if "role" in settings:  # what the variant stands for in a comparison (harness.roles); reports read it
            declared = settings.pop("role")
            if declared not in LEGACY:  # a kept file of older rows may say ours-default
                choice(path, f"variants.{vname}.role", declared, ROLES)
            role = roles[vname] = role_of({"role": declared, "stack": settings.get("stack")})
            if role == "user":  # optim.enable(model) with its defaults, built as a user builds it
                ours = sorted(k for k in settings if k in OWNER)
                if ours and declared not in LEGACY:
                    raise ExperimentError(path, f"variants.{vname}.role",
                                          f"'user' is optim.enable(model) with its defaults; a variant that sets "
                                          f"{ours} is 'ours' (or an 'ablation')")
                if "stack" not in settings:
                    settings["stack"] = implied = "user"
            if role == "unsloth" and "stack" not in settings:  # only Unsloth's own build plays Unsloth
                settings["stack"] = implied = "unsloth"
        if "loss" in settings:  # a variant may compute the loss its own way; not a model switch
            variant_loss[vname] = choice(path, f"variants.{vname}.loss", settings.pop("loss"), LOSSES)
        if "lora_dtype" in settings:  # likewise: how the harness builds the adapters
            variant_lora_dtype[vname] = choice(path, f"variants.{vname}.lora_dtype",
                                                settings.pop("lora_dtype"), LORA_DTYPES)
        if "stack" in settings:  # built as a user (optim.enable) or a peer (Liger-Kernel) would
            stack = variant_stack[vname] = choice(path, f"variants.{vname}.stack", settings.pop("stack"), rowmod.STACKS)
            ours = sorted(k for k in settings if k in OWNER)
            # a stack's variant plays the stack's role unless named; optim.enable with switches set is ours
            role = roles.setdefault(vname, "ours" if stack == "user" and ours else STACK_ROLE[stack])
            if role not in STACK_ROLES[stack]:
                raise ExperimentError(path, f"variants.{vname}.role",
                                      f"{declared or role!r} cannot be built by stack {stack!r}, whose variants play "
                                      f"{', '.join(STACK_ROLES[stack])}")
            if stack in ("liger", "compiled", "unsloth") and ours:
                raise ExperimentError(path, f"variants.{vname}.stack",
                                      f"{stack!r} runs without optim; drop the optim switch(es) {ours}")
            # where the role implied the stack, the error names the role, the key the file has
            where, why = ((f"variants.{vname}.role", f"role {roles[vname]!r} runs as its stack: ") if implied
                          else (f"variants.{vname}.stack", ""))
            if variant_loss.get(vname) == "chunked":
                raise ExperimentError(path, f"variants.{vname}.loss",
                                      f"{why}a user or peer stack takes the model's own loss (model(..., labels=...)), "
                                      "which optim.loss or Liger patches; drop loss = 'chunked'")
            variant_loss[vname] = "full"  # whatever the experiment's default
            # A peer's loop and the user's path run the step eagerly. A variant of stack "user" that
            # plays ours or an ablation (optim.enable(model), with its defaults or the switches it
            # sets) may be replayed as CUDA graphs: what a loop that captures its step with
            # optim.graphs.GraphedStep gets from the call.
            if settings.get("cuda_graph") and not (stack == "user" and role in ("ours", "ablation")):
                raise ExperimentError(path, where,
                                      f"{why}a user or peer stack runs the step eagerly, as their own loop does; "
                                      "drop cuda_graph from this variant (a variant of stack 'user' with role "
                                      "'ours' or 'ablation' may replay its step as CUDA graphs)")
        if "cuda_graph" in settings:  # how the harness runs the step (optim.graphs), not a model switch
            graphed = settings.pop("cuda_graph")
            if not isinstance(graphed, bool):
                raise ExperimentError(path, f"variants.{vname}.cuda_graph", f"must be true or false, got {graphed!r}")
            if graphed and device == "cpu":
                raise ExperimentError(path, f"variants.{vname}.cuda_graph",
                                      "replays the step as a CUDA graph, so it needs device = 'cuda' or 'auto'")
            if graphed and settings.get("offload", "none") != "none":
                raise ExperimentError(path, f"variants.{vname}.cuda_graph",
                                      "cannot capture optim.offload's host copies on side streams; "
                                      "set offload = 'none' in this variant")
            if graphed and settings.get("packing_backend") == "varlen" and data.distribution != "fixed":
                raise ExperimentError(path, f"variants.{vname}.cuda_graph",
                                      "varlen needs each batch's max_seqlen on the host, which a replayed graph "
                                      "cannot give when document lengths vary; use packing_backend 'flex' or "
                                      "'sdpa', or [data] distribution = 'fixed'")
            variant_cuda_graph[vname] = graphed
        for key, value in settings.items():
            choice(path, f"variants.{vname}.{key}", value, SWITCHES[key].choices)
        if settings.get("offload", "none") != "none" and settings.get("gradient_checkpointing", True) is False:
            raise ExperimentError(path, f"variants.{vname}.offload",
                                  "offloads checkpointed layer inputs, so it needs gradient_checkpointing = true")
        variants[vname] = dict(settings)

    if parallel:
        for vname, stack in variant_stack.items():
            if stack == "unsloth":
                raise ExperimentError(path, f"variants.{vname}.stack",
                                      "Unsloth's stack runs on one GPU here (its import opens a CUDA context before "
                                      "the ranks are set up); compare it in a file with parallel = \"none\"")
        for vname, graphed in variant_cuda_graph.items():
            if graphed:
                raise ExperimentError(path, f"variants.{vname}.cuda_graph",
                                      "a captured step cannot hold FSDP2's all-gathers and reduce-scatters, which its "
                                      "hooks issue around every layer; graph this variant in a file with "
                                      "parallel = \"none\"")
    baseline = exp.get("baseline", next(iter(variants)))
    choice(path, "experiment.baseline", baseline, list(variants))
    report = parse_report(path, raw.get("report", {}), variants)
    gate = (parse_gate(path, raw["gate"], canon, seq_lens, variants, variant_models, variant_seq_lens, roles)
            if "gate" in raw else None)

    return Experiment(
        name=name, path=str(path), description=str(exp.get("description", "")), models=canon,
        seq_lens=seq_lens, batch_size=batch_size, gpus=gpus, parallel=parallel, variants=variants,
        baseline_variant=baseline, warmup_steps=warmup, measured_steps=measured, repeats=repeats,
        lora_rank=lora_rank, dtype=dtype, device=device, launcher=launcher,
        timeout_s=float(timeout_s), bandwidth=bandwidth, collector=collector, data=data, pin_cpu=pin_cpu, loss=loss,
        variant_loss=variant_loss, lora_dtype=lora_dtype, variant_lora_dtype=variant_lora_dtype,
        variant_cuda_graph=variant_cuda_graph, variant_stack=variant_stack, roles=roles, report=report,
        requires=requires, variant_models=variant_models, variant_seq_lens=variant_seq_lens, gate=gate,
    )


def _variant_models(path, vname: str, raw: Any, models: list[str]) -> list[str]:
    key = f"variants.{vname}.models"
    if not isinstance(raw, list) or not raw:
        raise ExperimentError(path, key, f"must be a non-empty list of this file's models, got {raw!r}", models)
    out = []
    for i, m in enumerate(raw):
        try:
            name = model_registry.get(m).name
        except KeyError:
            name = None
        if name not in models:
            raise ExperimentError(path, f"{key}[{i}]", f"{m!r} is not one of [experiment] models", models)
        out.append(name)
    return out


def _variant_seq_lens(path, vname: str, raw: Any, seq_lens: list[int]) -> list[int]:
    key = f"variants.{vname}.seq_lens"
    if not isinstance(raw, list) or not raw:
        raise ExperimentError(path, key, f"must be a non-empty list of this file's seq_lens, got {raw!r}", seq_lens)
    for i, t in enumerate(raw):
        if isinstance(t, bool) or t not in seq_lens:
            raise ExperimentError(path, f"{key}[{i}]", f"{t!r} is not one of [experiment] seq_lens", seq_lens)
    return list(raw)


def _requires(path, raw: Any) -> dict[str, str]:
    """``requires = { transformers = ">=5.23" }``: each value a PEP 440 version specifier."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not isinstance(raw, dict):
        raise ExperimentError(path, "experiment.requires", "must be a table of package = \"version specifier\"")
    for pkg, spec in raw.items():
        try:
            if not isinstance(spec, str):
                raise InvalidSpecifier(repr(spec))
            SpecifierSet(spec)
        except InvalidSpecifier:
            raise ExperimentError(path, f"experiment.requires.{pkg}",
                                  f"{spec!r} is not a version specifier (such as \">=5.23\")") from None
    return dict(raw)


def check_requires(exp: Experiment) -> None:
    """Raise ExperimentError naming the first package of ``exp.requires`` that this environment
    lacks or has at another version: the rows would not measure what the file says."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    for pkg, spec in exp.requires.items():
        try:
            have = version(pkg)
        except PackageNotFoundError:
            have = None
        if have is None or have not in SpecifierSet(spec, prereleases=True):
            raise ExperimentError(exp.path, f"experiment.requires.{pkg}",
                                  f"needs {pkg}{spec}, this environment has {have or 'none installed'}")


def subset(exp: Experiment, *, models=None, seq_lens=None, variants=None) -> Experiment:
    """The same experiment restricted to some of its axes. Point identities do not change, so
    a partial run's rows resume into the full experiment."""
    def pick(key: str, wanted, have, canon=lambda x: x):
        if not wanted:
            return have
        out = []
        for w in wanted:
            c = canon(w)
            if c not in have:
                raise ExperimentError(exp.path, key, f"{w!r} is not in this experiment", have)
            out.append(c)
        return out

    def canon_model(m):
        try:
            return model_registry.get(m).name
        except KeyError:
            return m

    chosen = pick("experiment.variants", variants, list(exp.variants))
    return dataclasses.replace(
        exp,
        models=pick("experiment.models", models, exp.models, canon_model),
        seq_lens=pick("experiment.seq_lens", seq_lens, exp.seq_lens),
        variants={v: exp.variants[v] for v in chosen},
    )
