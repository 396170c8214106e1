"""Cell formatting shared by every report section: numbers, percentages, bytes, Markdown tables.

A formatted number is a ``Cell``: the text the report shows, which also keeps the value it was
formatted from. Every table a report renders goes through ``md_table``, which hands it, as data,
to any ``recording()`` in progress, so a test reads what a report computed (by column and row,
the values themselves) instead of matching its wording.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

import pandas as pd

MESSAGE_CHARS = 200


class Cell(str):
    """A formatted cell (its text, as the report shows it) that keeps ``value``, what it shows."""

    value: Any

    def __new__(cls, text: str, value: Any) -> "Cell":
        obj = super().__new__(cls, text)
        obj.value = value
        return obj


def joined(sep: str, *cells: Any, note: str = "") -> Cell:
    """Cells shown in one ("a / b", "a → b", with an optional note after): the cell keeps the tuple
    of their values, the note last where there is one."""
    text = sep.join(str(c) for c in cells) + (f" ({note})" if note else "")
    return Cell(text, tuple(value(c) for c in cells) + ((note,) if note else ()))


def value(cell: Any) -> Any:
    """What a cell shows: a ``Cell``'s value, or the cell itself (text, or a value not formatted)."""
    return cell.value if isinstance(cell, Cell) else cell


@dataclass
class Table:
    """A rendered table as data: its header and its body's cells (``Cell`` where formatted)."""

    header: list[str]
    body: list[list]

    def rows(self) -> list[dict[str, Any]]:
        """Each body row as {column: value}."""
        return [dict(zip(self.header, map(value, r))) for r in self.body]

    def column(self, name: str) -> list:
        i = self.header.index(name)
        return [value(r[i]) for r in self.body]

    def row(self, **match: Any) -> dict[str, Any]:
        """The one row whose cells equal ``match`` (column names with spaces: ``row(**{"a b": 1})``)."""
        found = [r for r in self.rows() if all(r.get(k) == v for k, v in match.items())]
        if len(found) != 1:
            raise LookupError(f"{len(found)} rows match {match} in a table of columns {self.header}")
        return found[0]


class Tables(list):
    """The tables a ``recording()`` saw, in the order they were rendered."""

    def find(self, *columns: str) -> Table:
        """The one table whose header has every column named."""
        found = [t for t in self if all(c in t.header for c in columns)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} tables have columns {columns}; headers: {[t.header for t in self]}")
        return found[0]


_RECORDINGS: list[Tables] = []


@contextlib.contextmanager
def recording() -> Iterator[Tables]:
    """Collect, as ``Table`` data, every table rendered inside the block."""
    tables = Tables()
    _RECORDINGS.append(tables)
    try:
        yield tables
    finally:
        _RECORDINGS.remove(tables)


def _cell(value) -> str:
    """A markdown table cell: a stray ``|`` or newline would otherwise break the table."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").strip()


def md_table(header: list[str], body: list[list]) -> str:
    for tables in _RECORDINGS:
        tables.append(Table(list(header), [list(row) for row in body]))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


# Options that say where rows go or how a run is paced, not what it measures: a reader's rerun
# of the command needs none of them, and --results would name a path of the machine that ran it.
_LOGISTICS = {"--results": 1, "--stop-after": 1, "--deadline": 1, "--point-estimate": 1, "--no-report": 0,
              "--quiet": 0, "--overwrite": 0, "--devices": -1}  # -1: every lane that follows (0 1, 0,1 2,3)


def _lane(word: str) -> bool:
    return bool(word) and not word.startswith("-") and all(c.isalnum() or c in ",-" for c in word)


def command(cmd: str) -> str:
    """A recorded command as a reader reruns it: the run's logistics options dropped."""
    import shlex

    try:
        words = shlex.split(cmd)
    except ValueError:
        return cmd
    out, skip = [], 0
    for w in words:
        if skip == -1 and _lane(w):
            continue
        if skip > 0:
            skip -= 1
            continue
        skip = 0
        name = w.split("=", 1)[0]
        if name in _LOGISTICS:
            skip = _LOGISTICS[name] if "=" not in w else 0
            continue
        out.append(w)
    return shlex.join(out)


def is_known(x) -> bool:
    return x is not None and not pd.isna(x)


def fmt_ms(x) -> str:
    if not is_known(x):
        return Cell("n/a", None)
    return Cell(f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}", x)


def fmt_num(x, fmt: str) -> str:
    return Cell(format(x, fmt), x) if is_known(x) else Cell("n/a", None)


def fmt_pct(x, note: str = "") -> str:
    """``x`` a fraction, shown in percent; the cell keeps the fraction."""
    if is_known(x):
        return Cell(f"{100 * x:.1f}%", x)
    return Cell(f"n/a ({note})" if note else "n/a", None)


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def truncate(text: str, limit: int = MESSAGE_CHARS) -> str:
    text = " ".join(str(text or "").split())  # tracebacks are multi-line; a table cell is not
    return text if len(text) <= limit else text[: limit - 1] + "…"


def gpu_slug(rows: list[dict]) -> str:
    return (rows[0].get("gpu_slug") if rows else None) or "unknown"


def point_label(model: str, seq_len: int, variant: str | None = None) -> str:
    return f"{model}\nT={seq_len}" + (f"\n{variant}" if variant else "")


def distinct(items, show=str) -> str:
    """Distinct values, sorted; several mean the rows were recorded under different set-ups,
    which the reader must see rather than have one silently chosen."""
    seen = sorted({show(v) for v in items if v is not None and v != ""})
    return ", ".join(seen) if seen else "unknown"


# Dash-aware variants for the optimization sections: anything missing renders as "–".
DASH = "–"
GIB = 2**30
MIB = 2**20
# ---------------------------------------------------------------------------------------------
# Formatting: report.py's number styles, with "–" for anything missing


def number(x) -> float | None:
    """A number, or None for missing / non-numeric / NaN values (so bad fields render, not crash)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not is_known(x) or math.isinf(x):
        return None
    return float(x)


def or_dash(x):
    return DASH if x is None or x == "" else x


def table(header: list[str], body: list[list]) -> str:
    return md_table(header, [[or_dash(cell) for cell in row] for row in body])


def ms(x) -> str:
    return fmt_ms(x) if number(x) is not None else Cell(DASH, None)


def num(x, spec: str) -> str:
    v = number(x)
    if v is None:
        return Cell(DASH, None)
    return Cell(format(round(v) if spec.endswith("d") else v, spec), x)


def times_text(x: float) -> str:
    """A speed-up to two decimals, rounded down: 1.2471 reads 1.24×, never the 1.25× a target
    of 1.25 would read as met. (The 1e-9 keeps an exact 1.25 from floating to 1.24.)"""
    return f"{math.floor(x * 100 + 1e-9) / 100:.2f}×"


def times(x) -> str:
    return Cell(times_text(x), x) if number(x) is not None else Cell(DASH, None)


def signed_pct(x) -> str:
    """x already in percent, signed: a gain or a cost; the cell keeps the percent."""
    return Cell(f"{x:+.1f}%", x) if number(x) is not None else Cell(DASH, None)


def stat(row: dict | None, metric: str, stat: str = "p50") -> float | None:
    stats = (row or {}).get(metric)
    return number(stats.get(stat)) if isinstance(stats, dict) else None


def spread(row: dict | None, metric: str) -> str:
    if row and row.get("status") not in (None, "ok"):
        return str(row.get("status")).upper()
    p50 = stat(row, metric)
    if p50 is None:
        return Cell(DASH, None)
    return Cell(f"{ms(p50)} [{ms(stat(row, metric, 'p20'))}–{ms(stat(row, metric, 'p80'))}]", p50)


def spreads_overlap(a: dict | None, b: dict | None, metric: str = "step_ms") -> bool:
    """Whether two rows' p20–p80 ranges of ``metric`` overlap: their run does not tell the two
    apart, whatever the ratio of medians says. False where either range is unknown."""
    lo = [stat(r, metric, "p20") for r in (a, b)]
    hi = [stat(r, metric, "p80") for r in (a, b)]
    if None in lo or None in hi:
        return False
    return max(lo) <= min(hi)


OVERLAP = "§"  # the marker of a ratio whose two spreads overlap (``spreads_overlap``)
OVERLAP_NOTE = (f"{OVERLAP} marks a speed-up whose two step-time spreads (p20–p80) overlap: the run does not "
                "tell the two apart.")


def gain_pct(slow, fast) -> float | None:
    """100·(slow/fast − 1): how much faster ``fast`` is (a steps/s gain), None if unknown."""
    slow, fast = number(slow), number(fast)
    return 100 * (slow / fast - 1) if slow is not None and fast else None


def diff(a, b) -> float | None:
    a, b = number(a), number(b)
    return a - b if a is not None and b is not None else None


def first(*values) -> float | None:
    return next((v for v in map(number, values) if v is not None), None)


def loss_note(rows) -> str:
    modes = {r.get("loss_mode") for r in rows}
    if modes == {"chunked"}:
        return (" The loss is chunked (`loss = \"chunked\"`: checkpointed 4096-token chunks in rows recorded "
                "before commit d0b891b, `optim.loss`'s linear + cross-entropy since), so at most one chunk's fp32 "
                "logits exist at a time and the peak shows what the layer inputs cost, not the logits of a "
                "152k-word vocabulary.")
    if "chunked" in modes:
        return " Some points compute the loss in chunks (`loss_mode` = chunked), others with full logits."
    return ""


def natural(text) -> tuple:
    """Sort key reading digit runs as numbers: qwen3-8b before qwen3-14b."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(text)))


def met(ok: bool | None, note: str = "") -> str:
    """Whether a target is met (the cell keeps ``ok``: True, False or None for not judged)."""
    text = DASH if ok is None else ("yes" if ok else "no")
    return Cell(f"{text} ({note})" if note else text, ok)



