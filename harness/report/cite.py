"""Figures keyed to the rows that give them. A generated block cites each measured figure through
``Figures``, which records a key beside it; ``keys_comment`` writes the keys as an HTML comment that
closes the block, one line per figure::

    158.2 ms = ms user-moe/nvidia-h100-80gb-hbm3/3f0c…@2026-11-26T08:48:10+00:00 step_ms.p50
    3.89× = ratio user-moe/…/9a1e…@… step_ms.p50 / user-moe/…/3f0c…@… step_ms.p50

A key names the experiment, GPU type, point id and recording time of its row, and the statistic.
``check_keys`` reads each back from ``results/`` alone, through the rows the report reads
(``current.split``): a figure typed by hand, a row gone stale (newer code measured the point, the
experiment file changed) or a figure with no key is a problem. ``loose_figures`` finds measured
figures in text outside such a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.report import fmt

KEYS = "<!-- figure keys (shown = format experiment/gpu/point@recorded statistic):"
# A measured figure as prose cites one: a number with a unit of time, memory, bandwidth or share,
# a ratio ("3.14×", "1.5x") or a signed change ("+2 %", "±3.1 %"). A setting (a chunk of `256 MiB`,
# a threshold of `5 %`) is written in a code span, which ``loose_figures`` leaves aside.
FIGURE = re.compile(r"(?<![\w.])(?:\d+(?:\.\d+)?\s?(?:ms|µs|s|min|GiB|MiB|KiB|GB/s|%)|\d+(?:\.\d+)?[×x])(?!\w)"
                    r"|(?<![\w.])[+−±-]\d+(?:\.\d+)?\s?%")


class CiteError(ValueError):
    """A figure key that is malformed or names no current row."""


@dataclass
class Figures:
    """The figures a block cites, each with its key, in the order written."""

    keys: list[tuple[str, str]] = field(default_factory=list)  # (shown, key)

    def _cite(self, shown: str, key: str) -> str:
        self.keys.append((shown, key))
        return shown

    def ms(self, row: dict) -> str:
        return self._cite(f"{fmt.stat(row, 'step_ms'):.1f} ms", f"ms {row_key(row)} step_ms.p50")

    def gib(self, row: dict) -> str:
        return self._cite(f"{float(row['peak_allocated_gib']):.2f} GiB", f"gib {row_key(row)} peak_allocated_gib")

    def ratio(self, num: dict, den: dict) -> str:
        """num's step over den's: how many times faster den is."""
        return self._cite(fmt.times_text(fmt.stat(num, 'step_ms') / fmt.stat(den, 'step_ms')),
                          f"ratio {row_key(num)} step_ms.p50 / {row_key(den)} step_ms.p50")


def row_key(r: dict) -> str:
    return f"{r['experiment']}/{r['gpu_slug']}/{r['point_id']}@{r['recorded_at']}"


FORMATS = {"ms": lambda v: f"{v:.1f} ms", "gib": lambda v: f"{v:.2f} GiB", "ratio": fmt.times_text}


def _stat(r: dict, path: str):
    v = r
    for part in path.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return fmt.number(v)


def _current_rows(results_root: Path, experiment: str, cache: dict) -> list[dict]:
    from harness.report.blog import data  # the rows the report reads

    if experiment not in cache:
        cache[experiment] = data.load_rows(results_root, [experiment])
    return cache[experiment]


def _row(results_root: Path, key: str, cache: dict) -> dict:
    try:
        where, recorded = key.split("@", 1)
        experiment, gpu, point = where.split("/")
    except ValueError:
        raise CiteError(f"figure key {key!r} is not experiment/gpu/point@recorded") from None
    found = [r for r in _current_rows(results_root, experiment, cache)
             if r.get("gpu_slug") == gpu and r.get("point_id") == point and str(r.get("recorded_at")) == recorded]
    if len(found) != 1:
        raise CiteError(f"figure key {key!r}: {len(found)} current rows under results/{experiment}/ "
                            "(0: the row is gone or stale, newer code or another experiment file measured the point)")
    return found[0]


def resolve(results_root: Path | str, line: str, cache: dict | None = None) -> tuple[str, str]:
    """One key line -> (the figure shown, the figure its row gives). Reads results/ only."""
    cache = {} if cache is None else cache
    shown, _, spec = line.partition(" = ")
    words = spec.split()
    if not words or words[0] not in FORMATS:
        raise CiteError(f"figure key line {line!r}: expected 'shown = ms|gib|ratio ROW STAT [/ ROW STAT]'")
    kind, rest = words[0], words[1:]
    ratio = kind == "ratio" and len(rest) == 5 and rest[2] == "/"
    if not (ratio or kind != "ratio" and len(rest) == 2):
        raise CiteError(f"figure key line {line!r}: expected 'shown = ms|gib|ratio ROW STAT [/ ROW STAT]'")
    root = Path(results_root)
    value = _stat(_row(root, rest[0], cache), rest[1])
    if ratio:
        den = _stat(_row(root, rest[3], cache), rest[4])
        value = value / den if value is not None and den else None
    return shown.strip(), FORMATS[kind](value) if value is not None else "no value"


def keys_comment(f: Figures) -> str:
    """The comment that closes a block: one key line per figure, in the order cited."""
    return KEYS + "\n" + "\n".join(f"{shown} = {key}" for shown, key in f.keys) + "\n-->"


def check_keys(block: str, results_root: Path | str) -> list[str]:
    """Problems of a block that ends in ``keys_comment``: a key that reads back to another figure
    than the one shown or to no current row, and a figure in the block with no key."""
    if KEYS not in block:
        return ["the block has no figure keys"]
    body, keys = block.split(KEYS, 1)
    keys = keys.split("-->", 1)[0]
    out, keyed, cache = [], [], {}
    for line in keys.strip().splitlines():
        try:
            shown, value = resolve(results_root, line, cache)
        except CiteError as e:
            out.append(str(e))
            continue
        keyed.append(shown)
        if shown != value:
            out.append(f"shows {shown} where its row gives {value}: {line}")
    cited = FIGURE.findall(re.sub(r"<!--.*?-->", "", body, flags=re.S))
    if sorted(cited) != sorted(keyed):
        extra = sorted(set(cited) ^ set(keyed)) or sorted(cited)
        out.append(f"figures in the block with no key, or keys with no figure: {extra[:10]}")
    return out


def loose_figures(text: str) -> list[str]:
    """Measured figures in ``text``; code blocks, code spans (settings) and HTML comments aside."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return FIGURE.findall(re.sub(r"`[^`\n]*`", "", text))
