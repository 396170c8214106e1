"""The report's PNGs: one function per figure, each returning the written path or None."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from harness.report import fmt
from harness.report.frames import PHASE_COLORS, PHASES, STATS, points_frame
from harness.report.output import save_png
from harness.report.palette import ROLE_COLOR, ROLE_LABEL, ROLE_MARKER, ROLES

# ---------------------------------------------------------------------------------------------
# Plots: one function per figure, each returns the written path or None when there is nothing
# to draw. Figures are built without pyplot so no global backend state or open figure leaks.


def save_figure(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    if not fig.legends:  # legend_below() has laid the figure out already
        fig.tight_layout()
    return save_png(fig, path)


# Ten colours, then the same ten dashed, then dotted: up to 30 variants each drawn its own way, and
# a variant keeps its look in every panel of a figure.
_COLORS = tuple(f"C{i}" for i in range(10))
_DASHES = ("-", "--", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def variant_styles(variants) -> dict[str, dict]:
    """variant -> matplotlib keywords (color, linestyle, marker), fixed by the sorted names."""
    out = {}
    for i, v in enumerate(sorted(set(variants))):
        out[v] = {"color": _COLORS[i % 10], "linestyle": _DASHES[(i // 10) % 3],
                  "marker": _MARKERS[(i + 3 * (i // 10)) % 10]}
    return out


def role_styles() -> dict[str, dict]:
    """role label -> matplotlib keywords: the roles of ``frames.role_frame`` in the colours the
    blog gives them, in the order a reader compares them."""
    return {ROLE_LABEL[r]: {"color": ROLE_COLOR[r], "linestyle": "-", "marker": ROLE_MARKER[r]} for r in ROLES}


def legend_entries(axes) -> tuple[list, list]:
    """(handles, labels) of every axis in ``axes``, each label once, in drawing order."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    return handles, labels


def legend_below(fig: Figure, axes, ncol: int = 4, *, sort: bool = False, order=None) -> None:
    """One legend for the whole figure, below the axes, so it covers no data; each label once,
    in drawing order, in ``order`` (labels it lacks last) or, with ``sort``, by name (the order
    variant_styles gives its styles in)."""
    handles, labels = legend_entries(axes)
    if order is not None and labels:
        rank = {label: i for i, label in enumerate(order)}
        labels, handles = map(list, zip(*sorted(zip(labels, handles), key=lambda lh: rank.get(lh[0], len(rank)))))
    elif sort:
        labels, handles = map(list, zip(*sorted(zip(labels, handles), key=lambda lh: lh[0]))) if labels else ([], [])
    if not handles:
        fig.tight_layout()
        return
    longest = max(len(label) for label in labels)
    fits = int(fig.get_figwidth() / (0.6 + 0.075 * longest))  # columns the figure's width holds
    ncol = max(1, min(ncol, fits, len(labels)))
    rows = -(-len(labels) // ncol)
    height = fig.get_figheight()
    legend_in = 0.25 + 0.22 * rows  # inches the legend takes below the axes
    fig.set_figheight(height + legend_in)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, legend_in / (height + legend_in), 1, 1))


def _log_if_wide(ax, values, ratio: float = 8.0) -> None:
    """A log y axis, labelled in plain numbers, where the largest value is more than ``ratio``
    times the smallest."""
    vals = [float(v) for v in values if v == v and v > 0]
    if vals and max(vals) > ratio * min(vals):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))


def _minor_label(v: float, _pos=None) -> str:
    """2, 3 and 5 times a power of ten are labelled on a log axis; the other minor ticks are not."""
    if v <= 0:
        return ""
    mantissa = v / 10 ** math.floor(math.log10(v))
    return f"{v:g}" if round(mantissa) in (2, 3, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""


def by_gpus(frame: pd.DataFrame) -> pd.DataFrame:
    """Points on several GPUs are series of their own: "user" on 2 GPUs plots as "user ×2 GPUs"."""
    if frame.empty or "gpus" not in frame or int(frame["gpus"].max()) <= 1:
        return frame
    out = frame.copy()
    many = out["gpus"] > 1
    out.loc[many, "variant"] = out.loc[many, "variant"] + " ×" + out.loc[many, "gpus"].astype(str) + " GPUs"
    return out


def _timed(df_steps: pd.DataFrame) -> pd.DataFrame:
    """The step-time rows the step-time plot draws: whose variants set every plot's styles."""
    return by_gpus(df_steps[df_steps["metric"] == "step_ms"].dropna(subset=["p50"]))


def plot_step_time(df_steps: pd.DataFrame, path: Path, styles: dict | None = None) -> Path | None:
    """Step time against length, a panel per model, a line per variant; ``styles`` (variant ->
    look, e.g. ``role_styles()``) fixes the looks and the legend's order, else variant_styles."""
    df = _timed(df_steps)
    if df.empty:
        return None
    # Repeats of one point collapse to their median so each (variant, T) is one marker.
    df = df.groupby(["model", "variant", "seq_len"], as_index=False)[list(STATS)].median()
    models = sorted(df["model"].unique())
    order = list(styles) if styles else None
    styles = {**variant_styles(df["variant"]), **(styles or {})}
    fig = Figure(figsize=(5 * len(models), 4))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        here = df[df["model"] == model]
        for variant, g in here.groupby("variant", sort=True):
            g = g.sort_values("seq_len")
            err = [g["p50"] - g["p20"], g["p80"] - g["p50"]]
            ax.errorbar(g["seq_len"], g["p50"], yerr=err, capsize=3, label=variant, **styles[variant])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(here["seq_len"].unique()))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        _log_if_wide(ax, pd.concat([here["p20"], here["p80"]]))
        ax.set_title(model)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("step time p50 (ms), bars p20–p80")
        ax.grid(True, which="both", alpha=0.3)
    legend_below(fig, axes, sort=True, order=order)
    return save_figure(fig, path)


def _point_ticks(ax, labels: list[str], upright_up_to: int = 12) -> None:
    """One tick per bar group; past ``upright_up_to`` groups the three-line labels would run into
    each other, so they turn on their side (one line each) and the figure grows to hold them."""
    if len(labels) <= upright_up_to:
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        return
    ax.set_xticks(range(len(labels)), [label.replace("\n", " ") for label in labels], fontsize=7, rotation=90)
    fig = ax.get_figure()
    fig.set_figwidth(max(6.0, 2 + 0.3 * len(labels)))  # a line of text a group, not three
    fig.set_figheight(fig.get_figheight() + 0.07 * max(len(label) for label in labels))


def plot_phase_split(df_steps: pd.DataFrame, path: Path) -> Path | None:
    wide = by_gpus(points_frame(df_steps))
    wide = wide[wide["repeat"] == wide["repeat"].min()] if not wide.empty else wide
    if wide.empty or wide[[f"{p}_p50" for p in PHASES]].isna().all().all():
        return None
    labels = [fmt.point_label(r.model, r.seq_len, r.variant) for r in wide.itertuples()]
    fig = Figure(figsize=(max(6, 0.9 * len(labels)), 4.5))
    ax = fig.subplots()
    bottom = [0.0] * len(wide)
    for phase in PHASES:
        values = wide[f"{phase}_p50"].fillna(0).tolist()
        ax.bar(range(len(values)), values, bottom=bottom, label=phase.removesuffix("_ms"), color=PHASE_COLORS[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
    _point_ticks(ax, labels)
    ax.set_ylabel("p50 per phase (ms)")
    ax.set_title("forward / backward / optimizer split (first repeat)")
    ax.grid(True, axis="y", alpha=0.3)
    legend_below(fig, [ax])
    return save_figure(fig, path)


def plot_memory(df_steps: pd.DataFrame, path: Path) -> Path | None:
    wide = points_frame(df_steps)
    cols = ["peak_reserved_gib_p50", "peak_allocated_gib_p50"]
    if wide.empty or wide[cols].isna().all().all():
        return None  # CPU rows carry no CUDA allocator peaks
    wide = wide[wide["repeat"] == wide["repeat"].min()]
    labels = [fmt.point_label(r.model, r.seq_len, r.variant) for r in wide.itertuples()]
    fig = Figure(figsize=(max(6, 0.9 * len(labels)), 4.5))
    ax = fig.subplots()
    xs = list(range(len(labels)))
    width = 0.4
    for offset, col, name in ((-width / 2, cols[0], "peak reserved"), (width / 2, cols[1], "peak allocated")):
        ax.bar([x + offset for x in xs], wide[col].fillna(0).tolist(), width=width, label=name)
    _point_ticks(ax, labels)
    ax.set_ylabel("GiB")
    ax.set_title("peak VRAM per point (first repeat)")
    ax.grid(True, axis="y", alpha=0.3)
    legend_below(fig, [ax])
    return save_figure(fig, path)


def plot_speedup(df_speedup: pd.DataFrame, path: Path, df_steps: pd.DataFrame | None = None,
                 styles: dict | None = None) -> Path | None:
    """Bars of each variant's speed-up over the baseline; given the step rows (``df_steps``), each
    variant keeps the colour it has in the step-time plot, the baseline's left unused; ``styles``
    as for plot_step_time."""
    if df_speedup.empty:
        return None
    df = by_gpus(df_speedup).groupby(["model", "seq_len", "variant"], as_index=False)["speedup"].median()
    groups = sorted({(m, t) for m, t in zip(df["model"], df["seq_len"])})
    variants = sorted(df["variant"].unique())
    order = list(styles) if styles else None
    if order:
        variants.sort(key=lambda v: order.index(v) if v in order else len(order))
    styles = {**variant_styles(variants if df_steps is None else {*variants, *_timed(df_steps)["variant"]}),
              **(styles or {})}
    fig = Figure(figsize=(max(6, 2 + 0.4 * len(groups) * max(1, len(variants))), 4.5))  # 0.4 in a bar
    ax = fig.subplots()
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        sub = df[df["variant"] == variant].set_index(["model", "seq_len"])["speedup"]
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))]
        ys = [sub.get(key, float("nan")) for key in groups]
        dashed = styles[variant]["linestyle"] != "-"  # past ten variants: hatched bars
        bars = ax.bar(xs, ys, width=width, label=variant, color=styles[variant]["color"],
                      hatch="//" if dashed else None, edgecolor="white" if dashed else None)
        ax.bar_label(bars, fmt="%.2f×", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(groups)), [fmt.point_label(m, t) for m, t in groups], fontsize=8)
    baselines = ", ".join(sorted(df_speedup["baseline_variant"].unique()))
    ax.set_ylabel(f"speedup vs {baselines} (× of step p50)")
    ax.set_title("speedup vs baseline variant (> 1 is faster)")
    ax.grid(True, axis="y", alpha=0.3)
    legend_below(fig, [ax], ncol=6, sort=True, order=order)
    return save_figure(fig, path)


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
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt.size(int(v)) if v >= 1 else ""))
    ax.set_xlabel("copy size")
    ax.set_ylabel("GB/s")
    ax.set_title("host → device copy bandwidth (p20–p80 band)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    legend_below(fig, [ax], ncol=3)
    return save_figure(fig, path)


def embed_figure(path: Path | None, alt: str) -> str:
    return f"![{alt}]({path.name})" if path else ""


