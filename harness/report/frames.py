"""Rows → pandas frames: one row per (point, metric, statistic), points, speedups."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from harness.measure.flops import hfu_of
from harness.report.palette import ROLE_LABEL
from harness.roles import PARTS, parts, role_of

# Identity of one measured point. Only these columns (all filled, never None) index the frames,
# because pandas silently drops NaN keys when grouping.
ID_COLUMNS = ["gpu_slug", "device_name", "model", "family", "seq_len", "batch_size", "gpus", "variant",
              "baseline_variant", "role", "repeat", "point_id", "mfu_note"]
TIMED_METRICS = ("step_ms", "forward_ms", "backward_ms", "optimizer_ms")
# Single-valued metrics get p20 = p50 = p80 so the long frame has one shape for everything.
SCALAR_METRICS = ("steps_per_s", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "mfu", "hfu")
STATS = ("p20", "p50", "p80")
PHASES = ("forward_ms", "backward_ms", "optimizer_ms")
PHASE_COLORS = {"forward_ms": "#4C72B0", "backward_ms": "#DD8452", "optimizer_ms": "#55A868"}
STATISTIC = ("median with p20–p80 spread over measured steps; CUDA events around forward, backward "
             "and optimizer on GPU, perf_counter on CPU")

Section = Callable[[pd.DataFrame, pd.DataFrame, list, Path], str]


# ---------------------------------------------------------------------------------------------
# Rows → frames


def _identity(row: dict) -> dict:
    return {
        "gpu_slug": row.get("gpu_slug") or "unknown",
        "device_name": row.get("device_name") or (row.get("env") or {}).get("device_name") or "unknown",
        "model": row.get("model") or "unknown",
        "family": row.get("family") or "",
        "seq_len": int(row.get("seq_len") or 0),
        "batch_size": int(row.get("batch_size") or 0),
        "gpus": int(row.get("gpus") or 1),
        "variant": row.get("variant") or "",
        "baseline_variant": row.get("baseline_variant") or "",
        "role": role_of(row),  # in today's vocabulary, whatever the row's age
        "repeat": int(row.get("repeat") or 0),
        "point_id": row.get("point_id") or "",
        "mfu_note": row.get("mfu_note") or "",
    }


def steps_frame(rows: list[dict]) -> pd.DataFrame:
    """Long format: one row per (ok step point, metric) with p20/p50/p80; None becomes NaN."""
    records = []
    for row in rows:
        if row.get("kind") != "step" or row.get("status") != "ok":
            continue
        ids = _identity(row)
        for metric in TIMED_METRICS:
            stats = row.get(metric) or {}
            records.append({**ids, "metric": metric, **{s: stats.get(s) for s in STATS}})
        for metric in SCALAR_METRICS:
            value = hfu_of(row) if metric == "hfu" else row.get(metric)  # no HFU of an older FLOP count
            records.append({**ids, "metric": metric, **{s: value for s in STATS}})
    df = pd.DataFrame.from_records(records, columns=[*ID_COLUMNS, "metric", *STATS])
    df[list(STATS)] = df[list(STATS)].astype(float)
    # A point re-run after an error can leave two rows; the later one (file order) is the answer.
    return df.drop_duplicates(subset=[c for c in ID_COLUMNS if c != "mfu_note"] + ["metric"],
                              keep="last").reset_index(drop=True)


def bandwidth_frame(rows: list[dict]) -> pd.DataFrame:
    """Long format: one row per ok (memory kind, size) H2D copy measurement."""
    records = []
    for row in rows:
        if row.get("kind") != "bandwidth" or row.get("status") != "ok":
            continue
        gbps = row.get("gbps") or {}
        records.append({
            "gpu_slug": row.get("gpu_slug") or "unknown",
            "direction": row.get("direction") or "h2d",
            "memory": row.get("memory") or "unknown",
            "size_bytes": int(row.get("size_bytes") or 0),
            **{s: gbps.get(s) for s in STATS},
            "pcie_ceiling_gbps": row.get("pcie_ceiling_gbps"),
            "pcie_gen": row.get("pcie_gen"),
            "pcie_width": row.get("pcie_width"),
        })
    cols = ["gpu_slug", "direction", "memory", "size_bytes", *STATS, "pcie_ceiling_gbps", "pcie_gen", "pcie_width"]
    df = pd.DataFrame.from_records(records, columns=cols)
    df[[*STATS, "pcie_ceiling_gbps"]] = df[[*STATS, "pcie_ceiling_gbps"]].astype(float)
    return df.sort_values(["gpu_slug", "direction", "memory", "size_bytes"]).reset_index(drop=True)


def points_frame(df_steps: pd.DataFrame) -> pd.DataFrame:
    """Wide view of the long frame, one row per point, columns like ``step_ms_p50``; sorted with
    the baseline variant first so tables read baseline → candidates."""
    wanted = [f"{m}_{s}" for m in (*TIMED_METRICS, *SCALAR_METRICS) for s in STATS]
    if df_steps.empty:
        return pd.DataFrame(columns=[*ID_COLUMNS, *wanted])
    wide = df_steps.set_index([*ID_COLUMNS, "metric"])[list(STATS)].unstack("metric")
    wide.columns = [f"{metric}_{stat}" for stat, metric in wide.columns]
    wide = wide.reindex(columns=wanted).reset_index()
    wide["_not_baseline"] = wide["variant"] != wide["baseline_variant"]
    order = ["model", "seq_len", "batch_size", "gpus", "_not_baseline", "variant", "repeat"]
    return wide.sort_values(order).drop(columns="_not_baseline").reset_index(drop=True)


def speedup_frame(df_steps: pd.DataFrame) -> pd.DataFrame:
    """Each non-baseline point against its baseline measured in the same run on the same GPU:
    speedup = baseline step_ms p50 / variant step_ms p50 (> 1 means the variant is faster)."""
    cols = ["gpu_slug", "model", "seq_len", "batch_size", "gpus", "repeat", "baseline_variant", "variant",
            "baseline_step_ms_p50", "step_ms_p50", "speedup"]
    wide = points_frame(df_steps)
    if wide.empty:
        return pd.DataFrame(columns=cols)
    match = ["gpu_slug", "model", "seq_len", "batch_size", "gpus", "repeat"]
    base = wide[wide["variant"] == wide["baseline_variant"]][[*match, "variant", "step_ms_p50"]]
    base = base.rename(columns={"variant": "baseline_variant", "step_ms_p50": "baseline_step_ms_p50"})
    cand = wide[(wide["variant"] != wide["baseline_variant"]) & (wide["baseline_variant"] != "")]
    merged = cand.merge(base, on=[*match, "baseline_variant"], how="inner")
    merged["speedup"] = merged["baseline_step_ms_p50"] / merged["step_ms_p50"]
    return merged[cols].sort_values(["model", "seq_len", "batch_size", "gpus", "variant", "repeat"]).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# The roles a plot draws where an experiment ran more variants than a plot can tell apart

PLOT_VARIANTS = 5
_POINT = ["gpu_slug", "model", "seq_len", "batch_size", "gpus"]
def _plays(d: pd.DataFrame, part: str) -> pd.Series:
    """Which of the frame's rows may play ``part`` (harness.roles.parts, by the role each row records)."""
    return pd.Series([part in parts(r) for r in d[["role", "variant", "baseline_variant"]].to_dict("records")],
                     index=d.index, dtype=bool)


def role_frame(df_steps: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Where more than ``PLOT_VARIANTS`` variants ran and the rows name at least two of the roles
    (stock: the baseline; the peer; optim.enable()'s defaults; ours at its best): the long frame the
    plots draw instead, one series per role, each point's role played by its fastest variant (the
    median over repeats of step p50) under the role's label, with stock's as every series'
    baseline; and the picks (the point, ``series``, ``variant``, ``p50``) the report names under
    the plots. None where the plots can draw every variant."""
    if df_steps.empty or df_steps["variant"].nunique() <= PLOT_VARIANTS:
        return None
    step = df_steps[df_steps["metric"] == "step_ms"].dropna(subset=["p50"])
    med = step.groupby([*_POINT, "variant", "baseline_variant", "role"], as_index=False)["p50"].median()
    picks = [cand.loc[cand.groupby(_POINT)["p50"].idxmin()].assign(series=series)
             for series in PARTS if not (cand := med[_plays(med, series)]).empty]
    if len(picks) < 2:
        return None
    picks = pd.concat(picks, ignore_index=True)[[*_POINT, "series", "variant", "p50"]]
    frame = df_steps.merge(picks[[*_POINT, "series", "variant"]], on=[*_POINT, "variant"])
    frame["variant"] = frame["series"].map(ROLE_LABEL)
    frame["baseline_variant"] = ROLE_LABEL["stock"]
    frame["role"] = frame.pop("series")
    return frame[df_steps.columns].reset_index(drop=True), picks
