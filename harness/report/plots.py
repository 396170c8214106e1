"""The report's PNGs: one function per figure, each returning the written path or None."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from harness.report.fmt import _bytes, _point_label
from harness.report.frames import PHASE_COLORS, PHASES, STATS, points_frame
from harness.report.output import save_png

# ---------------------------------------------------------------------------------------------
# Plots: one function per figure, each returns the written path or None when there is nothing
# to draw. Figures are built without pyplot so no global backend state or open figure leaks.


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    return save_png(fig, path)


def by_gpus(frame: pd.DataFrame) -> pd.DataFrame:
    """Points on several GPUs are series of their own: "user" on 2 GPUs plots as "user ×2 GPUs"."""
    if frame.empty or "gpus" not in frame or int(frame["gpus"].max()) <= 1:
        return frame
    out = frame.copy()
    many = out["gpus"] > 1
    out.loc[many, "variant"] = out.loc[many, "variant"] + " ×" + out.loc[many, "gpus"].astype(str) + " GPUs"
    return out


def plot_step_time(df_steps: pd.DataFrame, path: Path) -> Path | None:
    df = by_gpus(df_steps[df_steps["metric"] == "step_ms"].dropna(subset=["p50"]))
    if df.empty:
        return None
    # Repeats of one point collapse to their median so each (variant, T) is one marker.
    df = df.groupby(["model", "variant", "seq_len"], as_index=False)[list(STATS)].median()
    models = sorted(df["model"].unique())
    fig = Figure(figsize=(5 * len(models), 4))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        for variant, g in df[df["model"] == model].groupby("variant", sort=True):
            g = g.sort_values("seq_len")
            err = [g["p50"] - g["p20"], g["p80"] - g["p50"]]
            ax.errorbar(g["seq_len"], g["p50"], yerr=err, marker="o", capsize=3, label=variant)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
        ax.set_title(model)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("step time p50 (ms), bars p20–p80")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_phase_split(df_steps: pd.DataFrame, path: Path) -> Path | None:
    wide = by_gpus(points_frame(df_steps))
    wide = wide[wide["repeat"] == wide["repeat"].min()] if not wide.empty else wide
    if wide.empty or wide[[f"{p}_p50" for p in PHASES]].isna().all().all():
        return None
    labels = [_point_label(r.model, r.seq_len, r.variant) for r in wide.itertuples()]
    fig = Figure(figsize=(max(6, 0.9 * len(labels)), 4.5))
    ax = fig.subplots()
    bottom = [0.0] * len(wide)
    for phase in PHASES:
        values = wide[f"{phase}_p50"].fillna(0).tolist()
        ax.bar(range(len(values)), values, bottom=bottom, label=phase.removesuffix("_ms"), color=PHASE_COLORS[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("p50 per phase (ms)")
    ax.set_title("forward / backward / optimizer split (first repeat)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_memory(df_steps: pd.DataFrame, path: Path) -> Path | None:
    wide = points_frame(df_steps)
    cols = ["peak_reserved_gib_p50", "peak_allocated_gib_p50"]
    if wide.empty or wide[cols].isna().all().all():
        return None  # CPU rows carry no CUDA allocator peaks
    wide = wide[wide["repeat"] == wide["repeat"].min()]
    labels = [_point_label(r.model, r.seq_len, r.variant) for r in wide.itertuples()]
    fig = Figure(figsize=(max(6, 0.9 * len(labels)), 4.5))
    ax = fig.subplots()
    xs = list(range(len(labels)))
    width = 0.4
    for offset, col, name in ((-width / 2, cols[0], "peak reserved"), (width / 2, cols[1], "peak allocated")):
        ax.bar([x + offset for x in xs], wide[col].fillna(0).tolist(), width=width, label=name)
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title("peak VRAM per point (first repeat)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_speedup(df_speedup: pd.DataFrame, path: Path) -> Path | None:
    if df_speedup.empty:
        return None
    df = by_gpus(df_speedup).groupby(["model", "seq_len", "variant"], as_index=False)["speedup"].median()
    groups = sorted({(m, t) for m, t in zip(df["model"], df["seq_len"])})
    variants = sorted(df["variant"].unique())
    fig = Figure(figsize=(max(6, 1.2 * len(groups) * max(1, len(variants))), 4.5))
    ax = fig.subplots()
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        sub = df[df["variant"] == variant].set_index(["model", "seq_len"])["speedup"]
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))]
        ys = [sub.get(key, float("nan")) for key in groups]
        bars = ax.bar(xs, ys, width=width, label=variant)
        ax.bar_label(bars, fmt="%.2f×", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(groups)), [_point_label(m, t) for m, t in groups], fontsize=8)
    baselines = ", ".join(sorted(df_speedup["baseline_variant"].unique()))
    ax.set_ylabel(f"speedup vs {baselines} (× of step p50)")
    ax.set_title("speedup vs baseline variant (> 1 is faster)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_bandwidth(df_bw: pd.DataFrame, path: Path) -> Path | None:
    if df_bw.empty:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for memory, g in df_bw.groupby("memory", sort=True):
        g = g.sort_values("size_bytes")
        line = ax.plot(g["size_bytes"], g["p50"], marker="o", label=f"{memory} (p50)")[0]
        ax.fill_between(g["size_bytes"], g["p20"], g["p80"], alpha=0.25, color=line.get_color())
    for ceiling in sorted(df_bw["pcie_ceiling_gbps"].dropna().unique()):
        ax.axhline(ceiling, color="gray", linestyle="--", label=f"PCIe ceiling {ceiling:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes(int(v)) if v >= 1 else ""))
    ax.set_xlabel("copy size")
    ax.set_ylabel("GB/s")
    ax.set_title("host → device copy bandwidth (p20–p80 band)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _embed(path: Path | None, alt: str) -> str:
    return f"![{alt}]({path.name})" if path else ""


