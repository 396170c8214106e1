"""The switches a sweep variant may set, with their valid values.

A variant in an experiment file is a named table of switch settings. Each switch is declared
here once, with its choices and its default, so that a malformed experiment fails before
anything runs and the error can list the valid choices. Adding an optimization means adding
its switches here and applying them in ``harness.point``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    name: str
    choices: tuple[Any, ...]
    default: Any
    help: str
    # Only meaningful for some model families (None: all).
    families: tuple[str, ...] | None = None


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "attn_implementation",
            ("sdpa", "eager", "flex_attention"),
            "sdpa",
            "stock transformers attention implementation (the peer baseline)",
        ),
        Switch(
            "experts_implementation",
            ("eager", "grouped_mm"),
            "grouped_mm",
            "stock transformers MoE experts implementation",
            families=("qwen3_moe", "gpt_oss"),
        ),
        Switch(
            "gradient_checkpointing",
            (True, False),
            True,
            "recompute each decoder layer in the backward instead of keeping its activations",
        ),
    )
}


def resolve(settings: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults for every switch a variant leaves out."""
    out = {name: sw.default for name, sw in SWITCHES.items()}
    out.update(settings)
    return out


def stock_attn_for(family: str, attn: str) -> str:
    """gpt-oss has no SDPA path in transformers (attention sinks); it falls back to eager."""
    if family == "gpt_oss" and attn == "sdpa":
        return "eager"
    return attn
