"""``experiments/blog.toml``: which experiments' rows each part of the blog report reads, the
published claims it sets beside them, and the runs that reproduce them (``harness.reproduce``).

A plan is config, not data: the report still reads every figure from ``results/``."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from harness.measured import REGISTRY
from harness.run.experiment import ExperimentError


@dataclass(frozen=True)
class Step:
    """One run of the reproduction: a sweep of an experiment file (optionally cut to some models,
    lengths or variants), a microbenchmark module writing rows for an experiment, or the context
    search of an experiment file (``python -m harness context``)."""
    name: str
    sweep: str | None = None  # experiment file, relative to the plan's folder
    bench: str | None = None  # harness.bench.<bench>
    context: str | None = None  # experiment file searched by ``python -m harness context``
    args: tuple[str, ...] = ()
    experiment: str | None = None  # the bench's --experiment
    min_gpu_gib: float = 0.0  # skipped on GPUs with less memory (Qwen3-32B needs the H200)
    estimate_s: float = 300.0  # the longest a single point or bench takes: no start with less left
    appendix: bool = False  # only the per-experiment tables read it: the report's figures do not wait on it
    # the cut's variants at each (model, length) are compared side by side: done only when their rows
    # come from one run, else run again together (reproduce.group_todo)
    together: bool = False

    @property
    def label(self) -> str:
        """The step's name as progress and status print it."""
        return self.name + (" (appendix)" if self.appendix else "")

    def models(self) -> tuple[str, ...]:
        """The models the step's arguments name (``--models a b`` or ``--model a --model b``); none
        when it runs every model of its file."""
        named, flag = [], None
        for w in self.args:
            if w.startswith("--"):
                flag = w
            elif flag in ("--models", "--model"):
                named.append(w)
                flag = None if flag == "--model" else flag
        return tuple(dict.fromkeys(named))

    def argv(self, plan_dir: Path) -> list[str]:
        if self.sweep:
            return ["-m", "harness", "sweep", str(plan_dir / self.sweep), "--no-report", *self.args]
        if self.context:
            return ["-m", "harness", "context", str(plan_dir / self.context), "--quiet", *self.args]
        return ["-m", f"harness.bench.{self.bench}", "--experiment", str(self.experiment), *self.args]


@dataclass(frozen=True)
class Plan:
    path: Path
    title: str
    sources: dict[str, tuple[str, ...]]  # section -> experiment names whose rows it reads
    seeds: dict = field(default_factory=dict)
    steps: tuple[Step, ...] = ()
    gate: dict = field(default_factory=dict)  # [blog.gate]: the gate runs its targets are judged from

    def experiments(self) -> list[str]:
        return sorted({e for names in self.sources.values() for e in names})

    def min_gib(self) -> dict[str, float]:
        """model -> the GPU memory the plan's steps naming it ask for (the largest), where any does."""
        need: dict[str, float] = {}
        for s in self.steps:
            for m in s.models() if s.min_gpu_gib else ():
                need[m] = max(need.get(m, 0.0), s.min_gpu_gib)
        return need


def _strs(path, key, value) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ExperimentError(path, key, f"must be an experiment name or a list of them, not {value!r}")
    return tuple(value)


def load(path: Path | str) -> Plan:
    """Parse and check a plan; any problem raises ``ExperimentError`` naming the file and key."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ExperimentError(path, "blog", f"cannot be read: {e}") from None
    blog = doc.get("blog")
    if not isinstance(blog, dict):
        raise ExperimentError(path, "blog", "missing: a plan has a [blog] table")
    unknown = set(blog) - {"title", "sources", "seeds", "steps", "gate"}
    if unknown:
        raise ExperimentError(path, "blog", f"unknown keys {sorted(unknown)}",
                              ["title", "sources", "seeds", "steps", "gate"])
    gate = blog.get("gate") or {}
    keys = ["a_a", "max_half_width", "must_fail", "must_pass", "max_minutes"]
    bad = set(gate) - set(keys) if isinstance(gate, dict) else {"gate"}
    if bad:
        raise ExperimentError(path, "blog.gate", f"unknown keys {sorted(bad)}", keys)
    raw = blog.get("sources")
    if not isinstance(raw, dict) or not raw:
        raise ExperimentError(path, "blog.sources", "missing: name the experiments each section reads", sorted(REGISTRY))
    sources = {}
    for section, names in raw.items():
        if section not in REGISTRY:  # each a measured optimization (harness.measured)
            raise ExperimentError(path, f"blog.sources.{section}", "is not a section", sorted(REGISTRY))
        sources[section] = _strs(path, f"blog.sources.{section}", names)
    steps, seen = [], set()
    for i, s in enumerate(blog.get("steps") or []):
        key = f"blog.steps[{i}]"
        if not isinstance(s, dict) or sum(k in s for k in ("sweep", "bench", "context")) != 1:
            raise ExperimentError(path, key, "needs exactly one of sweep = \"<file>.toml\", bench = \"<module>\" or "
                                             "context = \"<file>.toml\"")
        extra = set(s) - {"name", "sweep", "bench", "context", "args", "experiment", "min_gpu_gib", "estimate_s",
                          "appendix", "together"}
        if extra:
            raise ExperimentError(path, key, f"unknown keys {sorted(extra)}")
        for kind in ("sweep", "context"):
            if kind in s and not (path.parent / str(s[kind])).is_file():
                raise ExperimentError(path, f"{key}.{kind}", f"{s[kind]!r} is not a file beside the plan")
        if "bench" in s and not s.get("experiment"):
            raise ExperimentError(path, f"{key}.experiment", "missing: the experiment whose results the bench writes")
        args = s.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise ExperimentError(path, f"{key}.args", f"must be a list of command-line words, not {args!r}")
        for flag in ("appendix", "together"):
            if not isinstance(s.get(flag, False), bool):
                raise ExperimentError(path, f"{key}.{flag}", f"must be true or false, not {s[flag]!r}")
        if s.get("together") and "sweep" not in s:
            raise ExperimentError(path, f"{key}.together", "applies to a sweep step only")
        name = str(s.get("name") or s.get("sweep") or s.get("bench") or s.get("context"))
        if name in seen:
            raise ExperimentError(path, f"{key}.name", f"{name!r} names two steps: give each a distinct name")
        seen.add(name)
        steps.append(Step(name=name, sweep=s.get("sweep"), bench=s.get("bench"), context=s.get("context"),
                          args=tuple(map(str, args)),
                          experiment=s.get("experiment"), min_gpu_gib=float(s.get("min_gpu_gib", 0)),
                          estimate_s=float(s.get("estimate_s", 300)), appendix=s.get("appendix", False),
                          together=s.get("together", False)))
    return Plan(path=path, title=str(blog.get("title") or "Benchmark report"), sources=sources,
                seeds=blog.get("seeds") or {}, steps=tuple(steps), gate=gate)
