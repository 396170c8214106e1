"""The microbenchmarks' rows in an experiment's results → "Side-by-side benchmark" and "Targets".

``python -m harness.bench.offload|moe|packing`` append rows to ``results/<experiment>/<gpu>.jsonl``
beside the sweep's, told apart by ``kind`` (``offload``/``offload_summary``, ``moe_*``,
``packing_m``/``packing_counts``, ``loss_kernel``, ``trainer``). Each row carries the command that wrote it and its env.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from harness.measured import REGISTRY, bench_kinds
from harness.report import fmt
from harness.report.runs import other_code


@dataclass
class BenchGroup:
    """The bench rows of one GPU type."""

    slug: str
    rows: list[dict] = field(default_factory=list)

    @property
    def env(self) -> dict:
        return next((r["env"] for r in self.rows if isinstance(r.get("env"), dict)), {})


def bench_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") in bench_kinds()]


def groups(rows: list[dict]) -> list[BenchGroup]:
    out: dict[str, BenchGroup] = {}
    for r in bench_rows(rows):
        out.setdefault(r.get("gpu_slug") or "unknown", BenchGroup(r.get("gpu_slug") or "unknown")).rows.append(r)
    return [out[s] for s in sorted(out)]


def _device(g: BenchGroup) -> str:
    name = g.env.get("device_name")
    return f"{name} (`{g.slug}`)" if name else f"`{g.slug}`"


def _provenance(g: BenchGroup, experiment: str) -> str:
    e = g.env
    dirty = other_code(g.rows)
    shas = {str(s)[:12] + (" (dirty)" if dirty(r) else "")
            for r in g.rows if (s := r.get("git_sha") or (r.get("env") or {}).get("git_sha"))}
    if not shas and e.get("git_sha"):
        shas = {str(e["git_sha"])[:12]}
    setup = ", ".join(f"{k} {e[k]}" for k in ("torch", "transformers", "peft", "cuda", "driver") if e.get(k))
    commands = sorted({fmt.command(r["command"]) for r in g.rows if r.get("command")})
    made = (f" written by {fmt.distinct(f'`{c}`' for c in commands)}" if commands
            else " (the command was not recorded for these rows)")
    return (f"From the bench rows of `results/{experiment}/{g.slug}.jsonl`{made}"
            + (f": {setup}" if setup else "") + (f"; git {', '.join(sorted(shas))}" if shas else "") + ".")


def sections(rows: list[dict], experiment: str, spec: dict | None = None, out_dir=None) -> list[str]:
    """"## Side-by-side benchmark (one process)" and, where the experiment file's ``[report]``
    tables (``spec``) set targets, "## Targets" ([] when the experiment has no bench rows). A
    ``bench_tables`` hook that takes ``out_dir`` draws its figures there (the report's folder)."""
    spec = spec or {}
    found = groups(rows)
    if not found:
        return []
    side = ["## Side-by-side benchmark (one process)",
            f"Microbenchmark rows from `results/{experiment}/`, one table set per GPU type."]
    targets = []
    for g in found:
        body = [text for entry in REGISTRY.values() if (tables := entry.hook("bench_tables"))
                and (text := tables(g.rows, spec.get(entry.name) or {},
                                    **({"out_dir": out_dir} if "out_dir" in inspect.signature(tables).parameters else {})))]
        side += [f"### {_device(g)}", _provenance(g, experiment), *(body or ["No rows this report knows how to read."])]
        goals = [text for name, entry in REGISTRY.items() if name in spec and (judge := entry.hook("bench_targets"))
                 and (text := judge(g.rows, spec[name]))]
        if goals:
            targets += [f"### {_device(g)}", *goals]
    out = ["\n\n".join(side)]
    if targets:
        out.append("\n\n".join(["## Targets", "The published figures are Unsloth and NVIDIA's (NVIDIA B200); measured on the GPU "
                                "named below. met? compares the measured value only.", *targets]))
    return out


def sweep_targets(spec: dict, rows: list[dict]) -> list[str]:
    """End-to-end comparisons read from an experiment's sweep rows: one per section its file's
    ``[report.<section>]`` tables (``spec``) name (moe, packing)."""
    steps = [r for r in rows if r.get("kind") == "step"]
    if not steps:
        return []
    texts = [judge(steps, rows, spec[name]) for name, entry in REGISTRY.items()
             if name in spec and (judge := entry.hook("sweep_targets"))]
    text = "\n\n".join(x for x in texts if x)
    return ["## From the sweep rows: end-to-end comparisons and models\n\n" + text] if text else []
