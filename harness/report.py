"""results/ → reports/<experiment>/README.md plus PNG plots, one section per GPU type.

A report is a pure function of the result rows (see ``harness.results`` for the schema): it never
imports torch or runs a model, so it can be rebuilt anywhere, and rebuilding from the same rows
gives byte-identical markdown. Rows are turned into long-format DataFrames (one row per point and
metric, with p20/p50/p80 columns, like Liger-Kernel's benchmark visualizer), and every part of the
report is one function in ``SECTIONS`` so later work can register its own (e.g. "predicted vs
measured saving") without touching the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from harness import results as res

# Identity of one measured point. Only these columns (all filled, never None) index the frames,
# because pandas silently drops NaN keys when grouping.
ID_COLUMNS = ["gpu_slug", "device_name", "model", "family", "seq_len", "batch_size", "variant",
              "baseline_variant", "repeat", "point_id", "mfu_note"]
TIMED_METRICS = ("step_ms", "forward_ms", "backward_ms", "optimizer_ms")
# Single-valued metrics get p20 = p50 = p80 so the long frame has one shape for everything.
SCALAR_METRICS = ("steps_per_s", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "mfu", "hfu")
STATS = ("p20", "p50", "p80")
PHASES = ("forward_ms", "backward_ms", "optimizer_ms")
PHASE_COLORS = {"forward_ms": "#4C72B0", "backward_ms": "#DD8452", "optimizer_ms": "#55A868"}
MESSAGE_CHARS = 200
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
        "variant": row.get("variant") or "",
        "baseline_variant": row.get("baseline_variant") or "",
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
            value = row.get(metric)
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
    order = ["model", "seq_len", "batch_size", "_not_baseline", "variant", "repeat"]
    return wide.sort_values(order).drop(columns="_not_baseline").reset_index(drop=True)


def speedup_frame(df_steps: pd.DataFrame) -> pd.DataFrame:
    """Each non-baseline point against its baseline measured in the same run on the same GPU:
    speedup = baseline step_ms p50 / variant step_ms p50 (> 1 means the variant is faster)."""
    cols = ["gpu_slug", "model", "seq_len", "batch_size", "repeat", "baseline_variant", "variant",
            "baseline_step_ms_p50", "step_ms_p50", "speedup"]
    wide = points_frame(df_steps)
    if wide.empty:
        return pd.DataFrame(columns=cols)
    match = ["gpu_slug", "model", "seq_len", "batch_size", "repeat"]
    base = wide[wide["variant"] == wide["baseline_variant"]][[*match, "variant", "step_ms_p50"]]
    base = base.rename(columns={"variant": "baseline_variant", "step_ms_p50": "baseline_step_ms_p50"})
    cand = wide[(wide["variant"] != wide["baseline_variant"]) & (wide["baseline_variant"] != "")]
    merged = cand.merge(base, on=[*match, "baseline_variant"], how="inner")
    merged["speedup"] = merged["baseline_step_ms_p50"] / merged["step_ms_p50"]
    return merged[cols].sort_values(["model", "seq_len", "batch_size", "variant", "repeat"]).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Formatting


def _cell(value) -> str:
    """A markdown table cell: a stray ``|`` or newline would otherwise break the table."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").strip()


def _table(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def _isnum(x) -> bool:
    return x is not None and not pd.isna(x)


def _ms(x) -> str:
    if not _isnum(x):
        return "n/a"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _num(x, fmt: str) -> str:
    return format(x, fmt) if _isnum(x) else "n/a"


def _pct(x, note: str = "") -> str:
    if _isnum(x):
        return f"{100 * x:.1f}%"
    return f"n/a ({note})" if note else "n/a"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _truncate(text: str, limit: int = MESSAGE_CHARS) -> str:
    text = " ".join(str(text or "").split())  # tracebacks are multi-line; a table cell is not
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _slug(rows: list[dict]) -> str:
    return (rows[0].get("gpu_slug") if rows else None) or "unknown"


def _point_label(model: str, seq_len: int, variant: str | None = None) -> str:
    return f"{model}\nT={seq_len}" + (f"\n{variant}" if variant else "")


# ---------------------------------------------------------------------------------------------
# Plots: one function per figure, each returns the written path or None when there is nothing
# to draw. Figures are built without pyplot so no global backend state or open figure leaks.


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    # No "Software" stamp: a matplotlib upgrade alone should not change the committed PNGs.
    fig.savefig(path, format="png", dpi=110, metadata={"Software": None})
    return path


def plot_step_time(df_steps: pd.DataFrame, path: Path) -> Path | None:
    df = df_steps[df_steps["metric"] == "step_ms"].dropna(subset=["p50"])
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
    wide = points_frame(df_steps)
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
    df = df_speedup.groupby(["model", "seq_len", "variant"], as_index=False)["speedup"].median()
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


# ---------------------------------------------------------------------------------------------
# Sections: (df_steps, df_bw, rows, out_dir) -> markdown, all restricted to one GPU type.


def section_results(df_steps, df_bw, rows, out_dir) -> str:
    wide = points_frame(df_steps)
    if wide.empty:
        return "### Results\n\nNo step point finished ok on this GPU type."
    header = ["model", "seq_len", "batch", "variant", "repeat", "step ms p50 [p20–p80]", "fwd ms", "bwd ms",
              "opt ms", "steps/s", "tokens/s", "peak alloc GiB", "peak reserved GiB", "MFU", "HFU", "p80/p20"]
    body = []
    for r in wide.itertuples():
        spread = r.step_ms_p80 / r.step_ms_p20 if _isnum(r.step_ms_p20) and r.step_ms_p20 else float("nan")
        body.append([
            r.model, r.seq_len, r.batch_size, r.variant, r.repeat,
            f"{_ms(r.step_ms_p50)} [{_ms(r.step_ms_p20)}–{_ms(r.step_ms_p80)}]",
            _ms(r.forward_ms_p50), _ms(r.backward_ms_p50), _ms(r.optimizer_ms_p50),
            _num(r.steps_per_s_p50, ".2f"), _num(r.tokens_per_s_p50, ",.0f"),
            _num(r.peak_allocated_gib_p50, ".2f"), _num(r.peak_reserved_gib_p50, ".2f"),
            _pct(r.mfu_p50, r.mfu_note), _pct(r.hfu_p50, r.mfu_note), _num(spread, ".2f"),
        ])
    note = "fwd/bwd/opt are p50 per phase; p80/p20 is the step-time spread."
    return "### Results\n\n" + _table(header, body) + "\n\n" + note


def section_step_time(df_steps, df_bw, rows, out_dir) -> str:
    path = plot_step_time(df_steps, out_dir / f"{_slug(rows)}-step-time.png")
    if not path:
        return ""
    return "### Step time vs sequence length\n\n" + _embed(path, "step time vs sequence length")


def section_phase_split(df_steps, df_bw, rows, out_dir) -> str:
    path = plot_phase_split(df_steps, out_dir / f"{_slug(rows)}-phase-split.png")
    if not path:
        return ""
    return "### Forward / backward / optimizer split\n\n" + _embed(path, "phase split")


def section_memory(df_steps, df_bw, rows, out_dir) -> str:
    if df_steps.empty:
        return ""
    path = plot_memory(df_steps, out_dir / f"{_slug(rows)}-peak-memory.png")
    body = _embed(path, "peak VRAM") if path else "No device memory peaks recorded (CPU run)."
    return "### Peak memory\n\n" + body


def section_speedup(df_steps, df_bw, rows, out_dir) -> str:
    if df_steps.empty:
        return ""
    sp = speedup_frame(df_steps)
    if sp.empty:
        return "### Speedup vs baseline\n\nNo variant has a matching ok baseline point."
    path = plot_speedup(sp, out_dir / f"{_slug(rows)}-speedup.png")
    body = [[r.model, r.seq_len, r.batch_size, r.repeat, r.baseline_variant, r.variant,
             _ms(r.baseline_step_ms_p50), _ms(r.step_ms_p50), f"{r.speedup:.2f}×"] for r in sp.itertuples()]
    header = ["model", "seq_len", "batch", "repeat", "baseline", "variant", "baseline step ms p50",
              "variant step ms p50", "speedup"]
    return ("### Speedup vs baseline\n\n" + _embed(path, "speedup vs baseline") + "\n\n" + _table(header, body)
            + "\n\nspeedup = baseline step ms p50 / variant step ms p50, same model, seq_len, batch and repeat.")


def section_bandwidth(df_steps, df_bw, rows, out_dir) -> str:
    if df_bw.empty:
        return "### Host → device bandwidth\n\nNo bandwidth rows for this GPU type."
    path = plot_bandwidth(df_bw, out_dir / f"{_slug(rows)}-h2d-bandwidth.png")
    body = []
    for r in df_bw.itertuples():
        known = _isnum(r.pcie_ceiling_gbps) and _isnum(r.p50)
        of_ceiling = f"{100 * r.p50 / r.pcie_ceiling_gbps:.0f}%" if known else "n/a"
        gbps = f"{_num(r.p50, '.2f')} [{_num(r.p20, '.2f')}–{_num(r.p80, '.2f')}]"
        body.append([r.memory, _bytes(r.size_bytes), gbps, of_ceiling])
    table = _table(["memory", "size", "GB/s p50 [p20–p80]", "of PCIe ceiling"], body)
    return "### Host → device bandwidth\n\n" + _embed(path, "H2D bandwidth") + "\n\n" + table


def section_failed(df_steps, df_bw, rows, out_dir) -> str:
    failed = [r for r in rows if r.get("status") in ("oom", "error")]
    if not failed:
        return "### Failed points\n\nNone."
    def key(r: dict) -> tuple:
        return (r.get("kind") or "", r.get("model") or "", int(r.get("seq_len") or 0),
                int(r.get("batch_size") or 0), r.get("variant") or "", int(r.get("repeat") or 0),
                r.get("memory") or "", int(r.get("size_bytes") or 0), r.get("status") or "")

    body = [[r.get("kind", ""), r.get("model", ""), r.get("seq_len", ""), r.get("batch_size", ""),
             r.get("variant", r.get("memory", "")), r.get("repeat", ""), r.get("status", ""),
             _truncate(r.get("message", ""))] for r in sorted(failed, key=key)]
    return "### Failed points\n\n" + _table(
        ["kind", "model", "seq_len", "batch", "variant", "repeat", "status", "message"], body)


def _values(items, fmt=str) -> str:
    """Distinct values, sorted; several mean the rows were recorded under different set-ups,
    which the reader must see rather than have one silently chosen."""
    seen = sorted({fmt(v) for v in items if v is not None and v != ""})
    return ", ".join(seen) if seen else "unknown"


def section_methodology(df_steps, df_bw, rows, out_dir) -> str:
    envs = [r.get("env") or {} for r in rows]
    steps = [r for r in rows if r.get("kind") == "step"]

    def env(key: str, unit: str = "") -> str:
        return _values(e.get(key) for e in envs) + unit if any(e.get(key) is not None for e in envs) else "unknown"

    def git(e):
        sha = e.get("git_sha")
        if not sha:
            return None
        return sha[:12] + (" (dirty)" if e.get("git_dirty") else "")

    def pcie(gen_key, width_key):
        return _values(f"Gen{e.get(gen_key)} x{e.get(width_key)}" for e in envs
                       if e.get(gen_key) is not None or e.get(width_key) is not None)

    device = _values([e.get("device_name") for e in envs] + [r.get("device_name") for r in rows])
    repeats = {r.get("repeat") for r in steps if r.get("repeat") is not None}
    parts = [
        f"Measured on {device} (device count {env('device_count')}), host {env('hostname')}, {env('platform')}.",
        f"Driver {env('driver')}, CUDA {env('cuda')}, Python {env('python')}, torch {env('torch')}, "
        f"transformers {env('transformers')}, peft {env('peft')}; git {_values(git(e) for e in envs)}.",
        f"PCIe link {pcie('pcie_gen', 'pcie_width')} (max {pcie('pcie_max_gen', 'pcie_max_width')}); "
        f"SM clock {env('sm_clock_mhz', ' MHz')} (max {env('max_sm_clock_mhz', ' MHz')}), memory clock "
        f"{env('mem_clock_mhz', ' MHz')}, power limit {env('power_limit_w', ' W')}.",
        f"Each point runs in its own fresh process: {_values(r.get('warmup_steps') for r in steps)} warm-up steps, "
        f"then {_values(r.get('measured_steps') for r in steps)} measured steps, "
        f"{len(repeats) if repeats else 'unknown'} repeat(s); dtype {_values(r.get('dtype') for r in steps)}, "
        f"LoRA rank {_values(r.get('lora_rank') for r in steps)}, adapters in "
        f"{_values(r.get('lora_dtype', 'fp32') for r in steps)} (fp32: peft's default upcast).",
        f"Statistic: {STATISTIC}.",
        "The Python garbage collector is collected, frozen and disabled for the measured steps.",
        "Speedups are ratios of medians measured side by side in one run, on the same GPU type.",
    ]
    return "### Methodology\n\n" + " ".join(parts)


def section_spread(df_steps, df_bw, rows, out_dir) -> str:
    """Two spreads: within a run (p80/p20 of the step samples) and run to run (p80/p20 of the
    per-repeat medians, each repeat a fresh process). Host-bound steps show host jitter in the
    first; the second is what a regression gate compares."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "step" and r.get("status") == "ok":
            key = (r["model"], r["seq_len"], r.get("batch_size"), r["variant"])
            groups.setdefault(key, []).append(r)
    if not groups:
        return ""
    body = []
    worst = {False: [0.0, 0.0], True: [0.0, 0.0]}  # per how the step ran: [run to run, within]
    for key in sorted(groups):
        reps = groups[key]
        graphed = bool(reps[0].get("cuda_graph"))
        medians = [r["step_ms"]["p50"] for r in reps]
        within = max(r["step_ms"]["p80"] / r["step_ms"]["p20"] for r in reps)
        worst[graphed][1] = max(worst[graphed][1], within)
        if len(medians) > 1:
            q = pd.Series(medians).quantile([0.2, 0.8])
            run_to_run = q[0.8] / q[0.2]
            worst[graphed][0] = max(worst[graphed][0], run_to_run)
            r2r = f"{run_to_run:.3f}"
        else:
            r2r = "n/a (1 repeat)"
        body.append([key[0], key[1], key[2], key[3], len(reps),
                     " / ".join(f"{m:.1f}" for m in medians), r2r, f"{within:.3f}"])
    header = ["model", "seq_len", "batch", "variant", "repeats", "step ms p50 per repeat",
              "run-to-run p80/p20", "within-run p80/p20 (worst repeat)"]

    def worst_text(graphed: bool) -> str:
        run, step = worst[graphed]
        return (f"worst run-to-run spread {run:.3f}, worst within-run spread {step:.3f}" if run
                else f"worst within-run spread {step:.3f}")

    lines = []
    if any(r[0].get("cuda_graph") for r in groups.values()):
        lines.append(f"- Steps replayed as CUDA graphs (`cuda_graph = true`, optim.graphs): {worst_text(True)}. "
                     "The host issues one launch per phase, so these spreads are the GPU's.")
        if not all(r[0].get("cuda_graph") for r in groups.values()):
            lines.append(f"- Eager steps: {worst_text(False)}. A host-bound eager step (the GPU waits "
                         "for Python between kernels) varies with the host CPU; the graphed twin of the "
                         "same point shows what the GPU itself does.")
    else:
        lines.append(worst_text(False).capitalize() + ".")
    summary = "\n".join(lines)
    return "### Spread\n\n" + _table(header, body) + "\n\n" + summary


# Run in order for each GPU type; append to register more (each returns markdown or "" to skip).
SECTIONS: list[Section] = [
    section_results,
    section_step_time,
    section_phase_split,
    section_memory,
    section_speedup,
    section_spread,
    section_bandwidth,
    section_failed,
    section_methodology,
]


# ---------------------------------------------------------------------------------------------
# Entry points


def _summary(experiment: str, rows: list[dict], df_steps: pd.DataFrame) -> str:
    steps = [r for r in rows if r.get("kind") == "step"]
    ok = [r for r in steps if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") in ("oom", "error")]
    n_bw = sum(1 for r in rows if r.get("kind") == "bandwidth" and r.get("status") == "ok")
    models = _values(r.get("model") for r in steps)
    variants = _values(r.get("variant") for r in steps)
    gpus = _values(r.get("gpu_slug") for r in rows)
    return (f"{len(ok)} ok step points ({models}; variants {variants}), {len(failed)} failed, "
            f"{n_bw} bandwidth points, on {gpus}.")


def build_report(results_root: Path | str, experiment: str, reports_root: Path | str) -> Path:
    """Write reports/<experiment>/README.md and its PNGs from results/<experiment>/*.jsonl, plus the
    side-by-side bench outputs of results/<experiment>-bench/ (see harness.report_bench)."""
    from harness import report_bench  # imported here: it borrows this module's formatting helpers

    rows = res.load_experiment_rows(results_root, experiment)
    bench = report_bench.sections(results_root, experiment)
    profiles = report_bench.load_profiles(results_root, experiment)
    if not rows and not bench and not profiles:
        raise ValueError(f"no result rows for experiment {experiment!r} under {Path(results_root) / experiment}")
    out_dir = Path(reports_root) / experiment
    out_dir.mkdir(parents=True, exist_ok=True)
    # The folder is generated: plots from an earlier build (e.g. a GPU type since removed) would
    # otherwise linger next to a README that no longer links them.
    for stale in out_dir.glob("*.png"):
        stale.unlink()

    df_steps_all, df_bw_all = steps_frame(rows), bandwidth_frame(rows)
    sources = " and ".join(f"`results/{name}/`" for name, has in
                           ((experiment, rows), (f"{experiment}{report_bench.SUFFIX}", bench)) if has)
    parts = [f"# Benchmark report: {experiment}",
             f"Experiment `{experiment}`. {_summary(experiment, rows, df_steps_all)}" if rows
             else f"Experiment `{experiment}`: no sweep rows, only the side-by-side benchmark.",
             f"Generated by `python -m harness report` from {sources}; do not edit by hand."]
    for slug in sorted({r.get("gpu_slug") or "unknown" for r in rows}):
        gpu_rows = [r for r in rows if (r.get("gpu_slug") or "unknown") == slug]
        df_steps = df_steps_all[df_steps_all["gpu_slug"] == slug].reset_index(drop=True)
        df_bw = df_bw_all[df_bw_all["gpu_slug"] == slug].reset_index(drop=True)
        device = _values(r.get("device_name") for r in gpu_rows)
        parts.append(f"## {device} (`{slug}`)")
        parts += [text.strip() for section in SECTIONS
                  if (text := section(df_steps, df_bw, gpu_rows, out_dir)) and text.strip()]
    parts += report_bench.sweep_targets(experiment, rows, results_root)
    parts += report_bench.profile_sections(results_root, experiment)
    parts += bench
    readme = out_dir / "README.md"
    readme.write_text("\n\n".join(parts) + "\n")
    return readme


def build_all(results_root: Path | str, reports_root: Path | str) -> list[Path]:
    """One report per experiment folder under results_root that holds any rows, and one per
    results/<name>-bench/ folder of bench outputs (into reports/<name>/)."""
    from harness import report_bench

    root = Path(results_root)
    if not root.is_dir():
        return []
    # a folder of logs only is not an experiment
    names = {p.name for p in root.iterdir() if p.is_dir() and res.load_experiment_rows(root, p.name)}
    names |= report_bench.experiments(root)
    return [build_report(root, name, reports_root) for name in sorted(names)]
