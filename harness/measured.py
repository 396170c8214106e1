"""The measured optimizations, one entry each, as ``optim.MODULES`` lists the optimizations.

An entry owns what its experiment files may say under ``[report.<name>]`` (the keys naming
variants, checked against the file's variants, and its targets), the row kinds its
microbenchmark writes, and the modules holding its report parts and its part of the blog.
Experiment parsing, the results files, the report and the blog loop over ``REGISTRY``: adding
an optimization's measurement is its own files plus one line here (or one ``register`` call).

This module imports nothing: an experiment file is checked against it without torch or pandas.

A report module (``report``) may define any of these; each returns Markdown, "" for nothing:

- ``lead(steps, rows, spec, out_dir)``: a section that leads the report, before the per-GPU tables;
- ``sweep_targets(steps, rows, spec)``: end-to-end comparisons read from the sweep's rows;
- ``bench_tables(rows, spec[, out_dir])``: its side-by-side benchmark tables, from one GPU type's bench
  rows (with ``out_dir``, the report's folder, where it draws figures);
- ``bench_targets(rows, spec)``: the targets judged on those rows.

``steps`` are the sweep's step rows, ``rows`` every row of the experiment (or of the GPU type),
``spec`` its ``[report.<name>]`` table. ``lead``, ``sweep_targets`` and ``bench_targets`` run only
where the experiment file has that table. A blog module (``blog``) defines
``part(rows, spec, ctx) -> (markdown, Headline)`` (``harness.report.blog.common``: its line of the
TL;DR), ``ctx`` carrying the figure folder, the reports root and the blog plan.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Measured:
    name: str  # its [report.<name>] table
    variant_keys: tuple[str, ...] = ()  # keys of that table naming a variant of the file
    target_keys: tuple[str, ...] = ()  # keys of that table setting targets
    bench_kinds: tuple[str, ...] = ()  # the row kinds its microbenchmark writes
    report: str = ""  # the module of its report parts
    blog: str = ""  # the module of its blog part

    def hook(self, part: str) -> Callable | None:
        """The report function ``part`` (see the module's docstring), None where it has none."""
        return getattr(importlib.import_module(self.report), part, None) if self.report else None


REGISTRY: dict[str, Measured] = {m.name: m for m in (
    Measured("offload", (), ("seeds",), ("offload", "offload_summary"),
             "harness.report.offload", "harness.report.blog.offload"),
    Measured("moe", ("eager_experts", "loop", "sorted"),
             ("speedup", "sorted_over_loop", "completes", "fit_model", "seeds_ms", "seeds_routing"),
             ("moe_routing", "moe_experts", "moe_syncs", "moe_split_crossover", "moe_query_model"),
             "harness.report.moe", "harness.report.blog.moe"),
    Measured("packing", ("stock", "stock_compiled"), ("speedup", "seeds_cache_gain_pct", "seeds_m"),
             ("packing_m", "packing_counts", "attention_kernel"), "harness.report.packing",
             "harness.report.blog.packing"),
    Measured("loss", (), (), ("loss_kernel",), "harness.report.loss"),
    Measured("user", ("stock", "compiled", "liger", "unsloth", "user"), ("targets",), ("trainer",), "harness.report.user"),
    Measured("scaling", ("stock", "ours"), ("targets",), (), "harness.report.scaling"),
    Measured("context", (), ("targets",), (), "harness.report.context", "harness.report.blog.context"),
    Measured("memory", (), (), ("memory_peak",), "harness.report.memory"),
    Measured("convergence", (), ("max_held_out_over_ln_vocab", "max_rel_gap_curve", "max_rel_gap_held_out"),
             ("convergence",), "harness.report.convergence"),
)}


def register(entry: Measured) -> Measured:
    """Add (or replace) an entry; returns it."""
    REGISTRY[entry.name] = entry
    return entry


def bench_kinds() -> frozenset[str]:
    """Every row kind a registered microbenchmark writes."""
    return frozenset(k for m in REGISTRY.values() for k in m.bench_kinds)
