"""The command line's argument types: each parses one value or refuses it with one message that
argparse prints as the command's single error line."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def resources(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, _, amount = item.partition("=")
        try:
            out[name.strip()] = float(amount)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: give NAME=N, e.g. one_per_host=1") from None
        if not name.strip() or out[name.strip()] <= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: give NAME=N with N above 0")
    return out


def checked(cast, ok, expected: str):
    """An argparse type: ``cast(text)``, refused with one message unless ``ok(value)``."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


seconds = checked(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
minutes = checked(float, lambda v: 0 < v < math.inf, "a positive number of minutes")
seconds_or_zero = checked(float, lambda v: 0 <= v < math.inf, "a finite number of seconds, 0 or more")  # nan fails both
at_least_two = checked(int, lambda v: v >= 2, "a whole number of rounds, 2 or more")
probability = checked(float, lambda v: 0 < v < 0.5, "a significance level between 0 and 0.5")
mib = checked(float, lambda v: v >= 0, "a number of MiB, 0 or more")
