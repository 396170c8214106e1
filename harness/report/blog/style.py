"""One look for every figure of the blog report: a fixed colour per role, a line style per GPU,
the legend outside the axes, at most five lines a plot."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from harness.report.palette import ROLE_COLOR, ROLE_LABEL, ROLE_MARKER, ROLES  # noqa: F401 (the blog's modules read them here)
from harness.report.plots import legend_entries

GPU_STYLES = ("-", "--", ":", "-.")
GPU_MARKERS = ("o", "s", "^", "D")
MAX_LINES = 5


def gpu_short(device_name: str | None) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "H100"; the model name a reader knows the card by."""
    words = str(device_name or "unknown").replace("NVIDIA", "").split()
    return words[0] if words else "unknown"


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    fig = Figure(figsize=(width * ncols, height))
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def grid(n: int, width: float = 3.8, height: float = 3.4, max_cols: int = 3):
    """``n`` panels, at most ``max_cols`` a row: (figure, the n axes in reading order); empty cells
    of the last row are removed."""
    cols = min(n, max_cols)
    rows = -(-n // cols)
    fig = Figure(figsize=(width * cols, height * rows + 0.4))
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[n:]:
        fig.delaxes(ax)
    return fig, axes[:n]


def legend_outside(fig: Figure, axes, ncol: int = 3) -> None:
    """One legend for the figure, below the axes, so it never covers data; ``ncol`` entries a row
    (fewer for a narrow figure with long labels)."""
    handles, labels = legend_entries(axes)
    if len(handles) > MAX_LINES + 1:  # the y = x or 1.0 reference line may come on top
        raise ValueError(f"a blog figure draws at most {MAX_LINES} lines, not {len(handles)}: {labels}")
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), ncol), frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
        fig.tight_layout(rect=(0, 0.08 + 0.05 * ((len(labels) - 1) // ncol), 1, 1))
    else:
        fig.tight_layout()


def embed(path: Path | None, alt: str, readme_dir: Path) -> str:
    return f"![{alt}]({path.relative_to(readme_dir).as_posix()})" if path else ""
