"""The MoE report's host-sync table (``moe_syncs`` rows of ``harness.bench.moe``): each backend's
syncs per experts layer, counted at optim.moe's own sync points and observed in CUDA sync debug
mode, with older rows' observed counts marked where they may hold torch's notice on entering that
mode."""

from __future__ import annotations

from harness.report import fmt
from harness.report.moe_query import MOE_BACKENDS

NOTICE = "‡"


def _with_notice(r: dict, phase: str) -> bool:
    """A row whose observed count may hold torch's notice on entering sync debug mode: measured
    before the bench matched the sync warnings alone (no ``observed_syncs_only``) and above its count."""
    seen, counted = fmt.number(r.get(f"{phase}_observed")), fmt.number(r.get(f"{phase}_counted"))
    return not r.get("observed_syncs_only") and seen is not None and counted is not None and seen > counted


def observed_cell(r: dict, phase: str = "forward") -> str:
    """A row's observed count, marked where it may hold torch's notice (``notice_note``)."""
    cell = fmt.num(r.get(f"{phase}_observed"), "d")
    return f"{cell} {NOTICE}" if _with_notice(r, phase) else cell


def notice_note(rows: list[dict]) -> str:
    """The footnote to the marked observed counts, where a row has one."""
    if not any(_with_notice(r, p) for r in rows for p in ("forward", "backward")):
        return ""
    return (f"\n\n{NOTICE} Observed by an older bench, which took torch's once-per-process notice on entering "
            "sync debug mode (\"a prototype feature\") for one more sync, in the first backend its process "
            "measured; a run of `python -m harness.bench.moe` on that GPU replaces the row.")


def syncs_md(syncs: list[dict]) -> str:
    """The table of one GPU's ``moe_syncs`` rows, or "" where it has none."""
    if not syncs:
        return ""

    def pair(r, phase):
        return fmt.joined(" / ", fmt.num(r.get(f"{phase}_counted"), "d"), observed_cell(r, phase))

    body = [[r.get("model"), r.get("backend"), r.get("tokens"), pair(r, "forward"), pair(r, "backward"),
             fmt.num(r.get("per_model_forward"), "d")]
            for r in sorted(syncs, key=lambda r: (fmt.natural(r.get("model")), MOE_BACKENDS.index(r["backend"])
                                                  if r.get("backend") in MOE_BACKENDS else 9))]
    return "#### Host syncs per MoE layer\n\n" + fmt.table(
        ["model", "backend", "tokens", "forward counted / observed", "backward counted / observed",
         "counted per model forward"], body) + notice_note(syncs)
