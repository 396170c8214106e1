"""``[report.<section>]``: which measured optimizations a report adds from the rows (one section per
``harness.measured`` entry), the variants each compares (checked against the file's variants, so
renaming a variant fails at load instead of emptying a section) and its targets."""

from __future__ import annotations

from typing import Any

from harness.measured import REGISTRY
from harness.run.fields import ExperimentError, check_keys, choice


def parse_report(path, raw: Any, variants: dict) -> dict[str, dict[str, Any]]:
    """``[report.<section>]``: which optimization sections the report adds from the sweep rows,
    the variants each compares (by name, checked against ``variants``) and its targets."""
    if not isinstance(raw, dict):
        raise ExperimentError(path, "report", "must be a table of [report.<section>] tables", sorted(REGISTRY))
    out = {}
    for section, table in raw.items():
        entry = REGISTRY.get(section)
        if entry is None:
            raise ExperimentError(path, f"report.{section}", "unknown report section", sorted(REGISTRY))
        check_keys(path, f"report.{section}", table, set(entry.variant_keys) | set(entry.target_keys))
        for key in entry.variant_keys:
            if key in table:
                choice(path, f"report.{section}.{key}", table[key], list(variants))
        out[section] = dict(table)
    return out
