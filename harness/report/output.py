"""Writing a generated report folder so that a build that fails halfway loses nothing.

A report folder holds a README and the PNGs it links. Each file a build writes lands whole (a
temporary file, then a rename). Only once the README is written does the build remove the PNGs
it did not write (a GPU type or a figure that is gone); a build that raises leaves every earlier
file in place.

    with output.Build(folder) as build:
        ...                      # figures through save_png
        build.finish(folder / "README.md", text)
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_BUILD: contextvars.ContextVar[Build | None] = contextvars.ContextVar("report_build", default=None)


def _write_whole(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_png(fig: Figure, path: Path) -> Path:
    """``fig`` to ``path`` whole, counted as written by the build under way. No "Software" stamp:
    a matplotlib upgrade alone should not change the committed PNGs."""
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_whole(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None}))
    if (build := _BUILD.get()) is not None:
        build.written.add(path.resolve())
    return path


class Build:
    """One build of the report folder ``folder`` (a context manager): ``finish`` writes the README
    and then drops the PNGs in ``folder`` this build did not write."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.written: set[Path] = set()
        self._token = None

    def __enter__(self) -> Build:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._token = _BUILD.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _BUILD.reset(self._token)

    def finish(self, readme: Path, text: str) -> Path:
        _write_whole(readme, lambda tmp: tmp.write_text(text))
        for png in self.folder.glob("*.png"):
            if png.resolve() not in self.written:
                png.unlink()
        return readme
