"""The switches a sweep variant may set, with their valid values.

A variant in an experiment file is a named table of switch settings. Stock-transformers
switches are declared here; each ``optim`` module declares its own (``SWITCHES``) and they are
merged in below, so a malformed experiment fails before anything runs and the error can list
the valid choices.

A variant that sets none of an optim module's switches runs stock transformers for that part:
that is how the peer baselines are measured side by side with the optimizations.
"""

from __future__ import annotations

from typing import Any

from optim import MODULES
from optim.switches import DECLARED, Switch

# In the order optim.enable applies them.
OPTIM_MODULES = MODULES


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
            "stock transformers MoE experts implementation (MoE models only)",
        ),
        Switch(
            "gradient_checkpointing",
            (True, False),
            True,
            "recompute each decoder layer in the backward instead of keeping its activations",
        ),
    )
}


# The optim module that owns a switch; stock transformers switches have none.
OWNER: dict[str, str] = {}


def _merge_optim_switches() -> None:
    # from the declarations alone: checking an experiment file imports no torch
    for modname in OPTIM_MODULES:
        for name, sw in DECLARED[modname].items():
            SWITCHES[name] = sw
            OWNER[name] = modname


_merge_optim_switches()


def resolve(settings: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults for the stock switches a variant leaves out; optim switches stay as set."""
    out = {name: sw.default for name, sw in SWITCHES.items() if name not in OWNER}
    out.update(settings)
    return out


def optim_settings(switches: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The optim modules a point enables, each with the switches the variant set for it."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in switches.items():
        module = OWNER.get(name)
        if module:
            out.setdefault(module, {})[name] = value
    return {m: out[m] for m in OPTIM_MODULES if m in out}


def stock_attn_for(family: str, attn: str) -> str:
    """gpt-oss has no SDPA path in transformers (attention sinks); it falls back to eager."""
    if family == "gpt_oss" and attn == "sdpa":
        return "eager"
    return attn
