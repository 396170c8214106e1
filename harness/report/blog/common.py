"""Tables every section of the blog report shares: the four roles side by side, and where the
step's time and memory go."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from harness.report import fmt
from harness.report.blog.data import RolePoint
from harness.report.blog.style import ROLE_LABEL, ROLES


@dataclass
class Headline:
    """One line of the TL;DR."""
    optimization: str
    bottleneck: str
    measured: dict = field(default_factory=dict)  # GPU name -> text
    seeds: str = ""
    peers: dict = field(default_factory=dict)  # GPU name -> text


def gib(x) -> str:
    return "–" if fmt.number(x) is None else f"{fmt.number(x):.1f}"


def cell(p: RolePoint, role: str) -> str:
    r = p.rows.get(role)
    if r is None:
        return p.failed.get(role, "not run").upper() if role in p.failed else "not run"
    s = p.speedup(role) if role != "stock" else None
    apart = p.apart_from_stock(role)
    # the cell keeps (ms, speed-up over stock, whether another run than the stock's measured it)
    return fmt.Cell(fmt.ms(p.ms(role)) + (f" ({fmt.times(s)})" if s else "") + (OTHER_RUN if apart else ""),
                    (p.ms(role), s, apart))


# marks a role measured by another run than the stock row beside it: its ratio compares two runs
OTHER_RUN = " †"


def other_run_note(table: str) -> str:
    """The table, with a line under it saying what † means where a cell carries one."""
    return table + (f"\n\n{OTHER_RUN.strip()} measured by another run than the stock beside it: "
                    "its ratio compares two runs." if OTHER_RUN in table else "")


def peers_table(points: list[RolePoint]) -> str:
    """Per GPU, model and length: each role's median step (and its speed-up over stock), the best
    variant's name, and whether the four come from one run ("–" where one role alone was measured:
    nothing to compare)."""
    body = []
    for p in points:
        best = p.rows.get("best")
        together = "–" if len(p.rows) < 2 else {True: "yes", False: "no", None: "?"}[p.one_run()]
        body.append([p.gpu_name, p.model, p.seq_len, *(cell(p, r) for r in ROLES),
                     f"`{best.get('variant')}`" if best else "–", together])
    return other_run_note(fmt.table(["GPU", "model", "tokens", *(f"{ROLE_LABEL[r]} ms" for r in ROLES), "best variant",
                                  "one run"], body))


def split_table(points: list[RolePoint]) -> str:
    """Forward / backward / optimizer p50 and peak memory of each role at the given points."""
    body = []
    for p in points:
        for role in ROLES:
            r = p.rows.get(role)
            if r is None:
                continue
            body.append([p.gpu_name, f"{p.model} T={p.seq_len}", ROLE_LABEL[role], fmt.ms(fmt.stat(r, "step_ms")),
                         fmt.ms(fmt.stat(r, "forward_ms")), fmt.ms(fmt.stat(r, "backward_ms")), fmt.ms(fmt.stat(r, "optimizer_ms")),
                         gib(r.get("peak_allocated_gib"))])
    if not body:
        return ""
    return fmt.table(["GPU", "point", "role", "step ms", "forward", "backward", "optimizer", "peak GiB"], body)


def gains_text(values: list[tuple[str, float]]) -> str:
    """ "model: +x %" items joined, for the TL;DR."""
    return ", ".join(f"{label} {v:+.1f} %" for label, v in values) or "not measured"


def gains_range(pairs: list[dict], what: str) -> str:
    """The TL;DR's measure of an on/off pair over every model and length measured: the range and
    median of the step gain over the pairs whose two sides one run measured, how many of them gain
    no more than the step's own spread, and how many pairs two runs measured (left out). ``pairs``:
    dicts with ``gain_pct``, ``noise_pct``, ``seq_len`` and ``one_run``."""
    one = sorted((p for p in pairs if p.get("gain_pct") is not None and p.get("one_run") is not False),
                 key=lambda p: p["gain_pct"])
    apart = sum(1 for p in pairs if p.get("gain_pct") is not None and p.get("one_run") is False)
    if not one:
        return "not measured" + (f" in one run ({apart} pairs by two runs)" if apart else "")
    gains = [p["gain_pct"] for p in one]
    lengths = sorted({int(p["seq_len"]) for p in one})
    flat = sum(1 for p in one if p.get("noise_pct") is not None and abs(p["gain_pct"]) <= p["noise_pct"])
    span = f"{lengths[0]}–{lengths[-1]}" if len(lengths) > 1 else f"{lengths[0]}"
    text = (f"{gains[0]:+.1f} % to {gains[-1]:+.1f} % {what} (median {statistics.median(gains):+.1f} %) over {len(one)} "
            f"model × length pairs, {span} tokens; {flat} of them within the step's own spread")
    return text + (f"; {apart} pairs measured by two runs left out" if apart else "")


def stock_caveats(points: list[RolePoint]) -> str:
    """What the stock and peer columns compute that differs from each document alone, for the
    models among ``points`` where that is known (``tests/test_optim_enable.py`` checks it)."""
    if not any(p.model.startswith("gpt-oss") for p in points):
        return ""
    return ("**Stock gpt-oss does not keep packed documents apart.** transformers builds gpt-oss's "
            "attention masks without the position ids (in 5.17, which these GPU rows ran, and still in "
            "5.24, the newest tested), so in stock and under Liger-Kernel a packed row's later documents attend to the "
            "earlier ones: a different loss from each document alone, and on the full-attention layers "
            "more attention work than the documents need. Unsloth's gpt-oss attention (flex attention with "
            "sinks, in unsloth_zoo 2026.10.9's source) masks the whole row causally too, reading neither the "
            "position ids nor the document lengths; its own SFTTrainer turns padding-free batches off for "
            "gpt-oss. `optim.enable()` attends each document alone; stock Qwen3 and Llama do too. The CPU "
            "tests check the three models' stock and optim paths on every run.")
