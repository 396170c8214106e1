"""The blog report's figures: each function draws one PNG from plain numbers and returns its path
(None when there is nothing to draw)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import FuncFormatter

from harness.report.blog import style
from harness.report.blog.data import RolePoint
from harness.report.output import save_png


DRAWN = ("stock-compiled", "peer", "user", "best")  # every role beside stock, whose line is y = 1


def speedup_vs_length(points: list[RolePoint], path: Path, what: str) -> Path | None:
    """Speed-up over stock against sequence length: a panel per model and GPU, a line per role the
    points measured (every one: stock compiled, the peer, the user's path and ours at its best).
    A point whose role came from another run than its stock is drawn hollow."""
    panels = sorted({(p.model, p.gpu_name) for p in points if any(p.speedup(r) for r in DRAWN)},
                    key=lambda k: (k[1], k[0]))
    if not panels:
        return None
    roles = [r for r in DRAWN if any(p.speedup(r) for p in points)]
    fig, axes = style.grid(len(panels))
    lengths = sorted({p.seq_len for p in points})
    apart = False
    for ax, (model, gpu) in zip(axes, panels):
        ax.axhline(1.0, color=style.ROLE_COLOR["stock"], lw=1.2, label="stock = 1")
        for role in roles:
            pts = sorted((p.seq_len, s, not p.apart_from_stock(role)) for p in points
                         if p.model == model and p.gpu_name == gpu and (s := p.speedup(role)))
            if not pts:
                continue
            # best is often enable() itself: drawn wide and pale beneath, the default's line stays visible
            wide = dict(lw=6, alpha=0.35, markersize=9, zorder=1) if role == "best" else dict(lw=1.6, zorder=2)
            color = style.ROLE_COLOR[role]
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], color=color, marker=style.ROLE_MARKER[role],
                    label=style.ROLE_LABEL[role], **wide)
            hollow = [(x, y) for x, y, one in pts if not one]
            if hollow:
                apart = True
                ax.scatter(*zip(*hollow), s=70, facecolors="white", edgecolors=color, linewidths=1.5, zorder=3)
        if len(lengths) > 1 and lengths[-1] / max(lengths[0], 1) >= 4:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
        ax.set_title(f"{model}, {gpu}", fontsize=10)
        ax.set_xlabel("tokens per step")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    if apart:
        axes[0].scatter([], [], s=70, facecolors="white", edgecolors="black", label="from another run than its stock")
    axes[0].set_ylabel(f"speed-up over stock ({what})")
    style.legend_outside(fig, axes)
    return save_png(fig, path)


SERIES_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def predicted_vs_measured(pairs: list[tuple], path: Path, quantity: str) -> Path | None:
    """(GPU, predicted, measured[, within noise[, series[, two runs]]]) per point, and the y = x
    line: a marker shape per GPU, a colour per series (the backend, or the length: what the caller
    names), a point whose measured value is within its step-time spread drawn hollow, and a black
    cross on a point whose two sides two runs measured (the caller's caption says so)."""
    apart = [(t[1], t[2]) for t in pairs if len(t) > 5 and t[5] and t[1] is not None and t[2] is not None]
    pairs = [(t[0], t[1], t[2], len(t) > 3 and bool(t[3]), str(t[4]) if len(t) > 4 else "")
             for t in pairs if t[1] is not None and t[2] is not None]
    if not pairs:
        return None
    fig, (ax,) = style.figure(1, width=5.2, height=4.4)
    values = [v for _, p, m, _, _ in pairs for v in (p, m)]
    hi = max(values)
    log = all(v > 0 for v in values) and hi / min(values) >= 20  # else a negative gain would vanish
    lo = min(values) / 1.5 if log else min([p for _, p, _, _, _ in pairs] + [0.0])
    ax.plot([lo, hi * 1.1], [lo, hi * 1.1], color="black", lw=1, ls="--", label="y = x (the model holds)")
    series = sorted({s for *_, s in pairs}, key=fmt_natural)
    numeric = bool(series) and all(s.isdigit() for s in series)  # a length: a colour scale, not a legend entry each
    if numeric:
        from matplotlib import cm, colors

        scale = colors.LogNorm(vmin=min(map(int, series)), vmax=max(max(map(int, series)), min(map(int, series)) * 2))
        color = {s: cm.viridis(scale(int(s))) for s in series}
    else:
        color = {s: (SERIES_COLORS[i % len(SERIES_COLORS)] if s else style.ROLE_COLOR["best"]) for i, s in enumerate(series)}
    gpus = sorted({t[0] for t in pairs})
    for gi, gpu in enumerate(gpus):
        for s in series:
            for hollow in (False, True):
                xy = [(p, m) for g, p, m, f, ss in pairs if g == gpu and f == hollow and ss == s]
                if xy:
                    xs, ys = zip(*xy)
                    ax.scatter(xs, ys, marker=style.GPU_MARKERS[gi % 4], s=28, alpha=0.85,
                               facecolors="none" if hollow else [color[s]], edgecolors=[color[s]])
    if apart:
        ax.scatter(*zip(*apart), marker="x", s=18, color="black", linewidths=0.9, zorder=4)
    named = [s for s in series if s] if not numeric else []
    if 1 + len(gpus) + len(named) <= style.MAX_LINES + 1:  # the legend: a marker per GPU, a colour per series
        for gi, gpu in enumerate(gpus):
            ax.scatter([], [], marker=style.GPU_MARKERS[gi % 4], s=28, color="black", label=gpu)
    else:  # past the legend's budget the markers are named in the title, the colours keep the legend
        ax.set_title("markers: " + ", ".join(f"{'o s ^ D'.split()[gi % 4]} {gpu}" for gi, gpu in enumerate(gpus)),
                     fontsize=8)
    if numeric:
        bar = fig.colorbar(cm.ScalarMappable(norm=scale, cmap=cm.viridis), ax=ax, pad=0.02)
        bar.set_label("tokens per step")
        bar.set_ticks([int(x) for x in series], labels=series)
        bar.minorticks_off()
    else:
        for s in series:
            if s:
                ax.scatter([], [], marker="s", s=28, color=color[s], label=s)
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(f"predicted {quantity}")
    ax.set_ylabel(f"measured {quantity}")
    ax.grid(True, alpha=0.3)
    style.legend_outside(fig, [ax], ncol=3)
    return save_png(fig, path)


def fmt_natural(text: str) -> tuple:
    from harness.report.fmt import natural

    return natural(text)


def bandwidth(series: dict[tuple[str, str], list[tuple[int, float]]], ceilings: dict[str, float],
              path: Path) -> Path | None:
    """H2D GB/s against copy size: a line per (GPU, memory kind), the PCIe ceiling dashed."""
    if not series:
        return None
    fig, (ax,) = style.figure(1, width=6.0, height=4.0)
    gpus = sorted({g for g, _ in series})
    if 2 * len(gpus) + len(set(ceilings.values())) > style.MAX_LINES + 1:  # beyond two GPUs: pinned only
        series = {k: v for k, v in series.items() if k[1] == "pinned"}
    kind_color = {"pinned": style.ROLE_COLOR["best"], "pageable": style.ROLE_COLOR["stock"]}
    for (gpu, kind), pts in sorted(series.items()):
        gi = gpus.index(gpu)
        ax.plot(*zip(*sorted(pts)), color=kind_color.get(kind, "black"), ls=style.GPU_STYLES[gi % 4],
                marker=style.GPU_MARKERS[gi % 4], ms=4, label=f"{gpu}, {kind}")
    for c in sorted(set(ceilings.values())):
        ax.axhline(c, color="black", lw=1, ls="--", label=f"PCIe ceiling {c:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 2**20:g} MiB" if v < 2**30 else f"{v / 2**30:g} GiB"))
    ax.set_xlabel("copy size")
    ax.set_ylabel("host → device GB/s (p50)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    style.legend_outside(fig, [ax])
    return save_png(fig, path)
