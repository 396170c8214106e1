"""Whether a row of ``optim.enable()`` ran the defaults as they are now.

A row records every switch as it resolved (``switches_resolved``): its variant's own settings, its
``OPTIM_*`` variables, the rest the defaults of the code that ran it. A default changed since
leaves the row measuring a setting the call no longer gives: a report keeps its figure and says
which switch it ran otherwise, and how it is set now.
"""

from __future__ import annotations

from typing import Any


def _switches() -> dict:
    """optim's switches, as experiment files take them (``harness.variant_keys``)."""
    from harness.variant_keys import OWNER, SWITCHES

    return {name: SWITCHES[name] for name in OWNER}


def changed(row: dict | None) -> dict[str, tuple[Any, Any]]:
    """{switch: (as the row ran it, today's default)} for the switches that the row's variant and its
    OPTIM_* variables left at their default, and whose default is another value now."""
    row = row or {}
    sws = _switches()
    own = row.get("switches") or {}
    env = row.get("env_switches") or {}
    return {name: (ran, sws[name].default) for name, ran in sorted((row.get("switches_resolved") or {}).items())
            if name in sws and name not in own and sws[name].env_var not in env and ran != sws[name].default}


def note(row: dict | None) -> str:
    """"moe_saved=lean, all now" for each changed switch, "; "-joined ("" when none)."""
    return "; ".join(f"{name}={ran}, {now} now" for name, (ran, now) in changed(row).items())
