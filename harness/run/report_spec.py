"""``[report.<section>]``: which optimization sections a report adds from the sweep rows, the
variants each compares (checked against the file's variants) and its targets."""

from __future__ import annotations

from typing import Any

from harness.run.fields import ExperimentError, check_keys, choice


# What a report section may read from ``[report.<section>]``: the keys naming a variant of this
# file (checked here, so renaming a variant fails at load instead of emptying a section), and the
# targets it judges against. The section modules under harness/report/ read these tables.
REPORT_VARIANT_KEYS = {
    "packing": ("stock", "stock_compiled"),
    "moe": ("eager_experts", "loop", "sorted"),
    "offload": (),
    "user": ("stock", "liger", "user"),
    "scaling": ("stock", "ours"),
}
REPORT_TARGET_KEYS = {
    "packing": ("speedup", "seeds_cache_gain_pct", "seeds_m"),
    "moe": ("speedup", "sorted_over_loop", "completes", "fit_model", "seeds_ms", "seeds_routing"),
    "offload": ("seeds",),
    "user": ("targets",),
    "scaling": ("targets",),
}


def parse_report(path, raw: Any, variants: dict) -> dict[str, dict[str, Any]]:
    """``[report.<section>]``: which optimization sections the report adds from the sweep rows,
    the variants each compares (by name, checked against ``variants``) and its targets."""
    if not isinstance(raw, dict):
        raise ExperimentError(path, "report", "must be a table of [report.<section>] tables", sorted(REPORT_VARIANT_KEYS))
    out = {}
    for section, table in raw.items():
        if section not in REPORT_VARIANT_KEYS:
            raise ExperimentError(path, f"report.{section}", "unknown report section", sorted(REPORT_VARIANT_KEYS))
        check_keys(path, f"report.{section}", table,
                    set(REPORT_VARIANT_KEYS[section]) | set(REPORT_TARGET_KEYS[section]))
        for key in REPORT_VARIANT_KEYS[section]:
            if key in table:
                choice(path, f"report.{section}.{key}", table[key], list(variants))
        out[section] = dict(table)
    return out
