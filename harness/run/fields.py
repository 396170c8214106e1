"""The checks every table of an experiment file goes through, each failure one ``ExperimentError``
naming the file, the key and the valid choices."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from harness.errors import InputError


class ExperimentError(InputError):
    """A malformed experiment file. The message names the file, the key and the valid choices."""

    def __init__(self, path: str | Path, key: str, problem: str, choices: Any = None):
        self.path, self.key, self.problem, self.choices = str(path), key, problem, choices
        msg = f"{path}: [{key}] {problem}"
        if choices is not None:
            msg += f" (valid: {', '.join(map(str, choices))})"
        super().__init__(msg)


def check_keys(path, where: str, table: Any, valid: set[str]) -> None:
    if not isinstance(table, dict):
        raise ExperimentError(path, where, f"must be a table, got {type(table).__name__}")
    for key in table:
        if key not in valid:
            raise ExperimentError(path, f"{where}.{key}" if where else key, "unknown key", sorted(valid))


def integer(path, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExperimentError(path, key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ExperimentError(path, key, f"must be >= {minimum}, got {value}")
    return value


def int_list(path, key: str, value: Any, minimum: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ExperimentError(path, key, f"must be a non-empty list of integers, got {value!r}")
    out = [integer(path, f"{key}[{i}]", v, minimum) for i, v in enumerate(value)]
    no_repeats(path, key, out)
    return out


def no_repeats(path, key: str, items: list) -> None:
    """Each entry once: a repeated length or model is one point, swept twice under one id."""
    seen = set()
    for i, v in enumerate(items):
        if v in seen:
            raise ExperimentError(path, f"{key}[{i}]", f"{v!r} is listed twice")
        seen.add(v)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def name(path, key: str, value: Any) -> str:
    """A name that is also a folder under results/ and reports/: letters, digits, '.', '_' and '-',
    starting with a letter or digit (no '..', no slash, no space or newline)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ExperimentError(path, key, "must be a name of letters, digits, '.', '_' and '-', starting with a "
                                         f"letter or digit, got {value!r}")
    return value


def choice(path, key: str, value: Any, choices) -> Any:
    # by type too: 1 == True in Python, so `packing_cache = 1` would pass as the bool it is not
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ExperimentError(path, key, f"{value!r} is not a valid choice", choices)
    return value


def number_at_least(path, key: str, value: Any, minimum: float) -> float:
    """A finite number (not a bool, not a string) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ExperimentError(path, key, f"must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def positive_number(path, key: str, value: Any, *, below: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value) \
            or (below and value >= below):
        bound = f" and below {below:g}" if below else ""
        raise ExperimentError(path, key, f"must be a number above 0{bound}, got {value!r}")
    return float(value)
