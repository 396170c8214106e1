"""The MoE section: host syncs ∝ E against 1, the routing path, split LoRA's crossover, the published
step-time tables rebuilt beside stock, Liger-Kernel and ours, and how the ratio moves with length."""

from __future__ import annotations

from pathlib import Path

from harness.report import bench
from harness.report import fmt
from harness.report.moe_query import predicted_from_other_lengths
from harness.report.moe import (CROSSOVER_HEADER, CROSSOVER_NOTE, moe_crossover_body, moe_crossover_points,
                                gpu_memory_gib, moe_gap_md, moe_routing)
from harness.report.moe_syncs import notice_note, observed_cell
from harness.report.blog import figures
from harness.report.blog.common import Headline, cell, other_run_note, split_table, stock_caveats
from harness.report.blog.data import RolePoint, role_points
from harness.report.blog.style import ROLE_LABEL, ROLES, embed, gpu_short
from harness.roles import PEERS


def _syncs_md(rows: list[dict]) -> str:
    sy = [r for r in rows if r.get("kind") == "moe_syncs"]
    if not sy:
        return ""
    body = [[gpu_short(r.get("device_name")), r.get("model"), r.get("num_experts"), r.get("backend"),
             r.get("forward_counted"), "–" if r.get("forward_observed") is None else observed_cell(r),
             r.get("per_model_forward")]
            for r in sorted(sy, key=lambda r: (str(r.get("gpu_slug")), fmt.natural(str(r.get("model"))), str(r.get("backend"))))]
    return ("**Host syncs: ∝ E against 1.** The per-expert loop asks the device which rows each expert "
            "got, once per expert; grouping once (argsort + bincount) asks once; grouped_mm never asks.\n\n"
            + fmt.table(["GPU", "model", "E", "backend", "forward syncs per layer (counted)", "observed (CUDA sync debug)",
                      "per model forward"], body) + notice_note(sy))


def _gain(pct) -> str:
    """A steps/s gain in %, as a ratio once it passes 2× (+793 % reads worse than 8.9×)."""
    return "–" if pct is None else f"{pct:+.0f} %" if pct < 100 else fmt.times(1 + pct / 100)


def _per_gpu(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """(GPU, its bench rows) per GPU: the benches key their rows by model and tokens alone, so two
    GPUs' rows must not meet in one table without the GPU beside them."""
    return [(gpu_short(g.env.get("device_name") or g.rows[0].get("device_name")), g.rows) for g in bench.groups(rows)]


def _routing_md(rows: list[dict], seeds: dict) -> str:
    body = [[gpu, p["model"], p["tokens"],
             fmt.joined(" → ", fmt.ms(fmt.stat(p['backends'].get('loop'), 'forward_ms')),
                        fmt.ms(fmt.stat(p['backends'].get('sorted'), 'forward_ms'))),
             fmt.joined(" → ", fmt.ms(fmt.stat(p['backends'].get('loop'), 'backward_ms')),
                        fmt.ms(fmt.stat(p['backends'].get('sorted'), 'backward_ms'))),
             _gain(p["sorted_over_loop_forward_ms"]), _gain(p["sorted_over_loop_backward_ms"])]
            for gpu, rs in _per_gpu(rows) for p in moe_routing(rs)]
    if not body:
        return ""
    claim = (f" Unsloth and NVIDIA measured +{seeds.get('forward_ms'):g} % forward and +{seeds.get('backward_ms'):g} % "
             "backward on the routing path (B200).") if seeds else ""
    return ("**The routing path alone** (gather rows per expert, weight, scatter back; no expert GEMMs), "
            "loop → sorted, p50 ms." + claim + "\n\n"
            + fmt.table(["GPU", "model", "tokens", "forward ms", "backward ms", "forward gain", "backward gain"], body))


def _crossover_md(rows: list[dict]) -> str:
    body = [[gpu, *line] for gpu, rs in _per_gpu(rows) for line in moe_crossover_body(rs)]
    if not body:
        return ""
    return "\n\n".join(x for x in ("**Split LoRA's crossover.**", fmt.table(["GPU", *CROSSOVER_HEADER], body),
                                     CROSSOVER_NOTE, _crossover_check(rows)) if x)


def crossover_checks(rows: list[dict]) -> list[dict]:
    """The layer's crossover by FLOPs (where split's LoRA FLOPs, linear in tokens, reach merged's
    fixed ones) against the one measured, per GPU and model: ``predicted`` tokens, and the point
    ``measured`` (the first length at which split was no faster, ``slower`` True; else the longest
    length run, ``slower`` False)."""
    out = []
    for gpu, rs in _per_gpu(rows):
        pts = moe_crossover_points(rs)
        for model in sorted({p["model"] for p in pts}, key=fmt.natural):
            mine = [p for p in pts if p["model"] == model and p["ms_merged"] and p["ms_split"]]
            pred = next((p["tokens"] * p["flops_merged"] / p["flops_split"] for p in mine
                         if p["flops_merged"] and p["flops_split"]), None)
            if not mine or pred is None:
                continue
            slower = [p for p in mine if p["ms_split"] >= p["ms_merged"]]
            out.append({"gpu": gpu, "model": model, "predicted": pred, "slower": bool(slower),
                        "measured": slower[0] if slower else mine[-1]})
    return out


def _crossover_check(rows: list[dict]) -> str:
    """``crossover_checks`` as the blog's lines."""
    lines, beyond = [], False
    for c in crossover_checks(rows):
        p, pred = c["measured"], c["predicted"]
        if c["slower"]:
            seen = f"split no faster from {p['tokens']:,} tokens ({fmt.ms(p['ms_split'])} against {fmt.ms(p['ms_merged'])} ms)"
        else:
            beyond |= p["tokens"] > pred
            seen = (f"split faster at every length run, up to {p['tokens']:,} tokens "
                    f"({fmt.ms(p['ms_merged'])} → {fmt.ms(p['ms_split'])} ms, "
                    f"{fmt.number(p['flops_merged']) / 1e9:,.1f} → {fmt.number(p['flops_split']) / 1e9:,.1f} GFLOP, merged → split)")
        lines.append(f"- {c['model']}, {c['gpu']}: predicted {pred:,.0f} tokens; measured: {seen}.")
    if not lines:
        return ""
    text = ("**Predicted against measured.** By the layer's LoRA FLOPs (both projections), split stops "
            "paying where its FLOPs reach merged's:\n\n" + "\n".join(lines))
    if beyond:
        text += ("\n\nSplit kept its lead past the FLOP crossover. The FLOP count is not the merged path's "
                 "whole cost: it also forms B·A for all E experts, a tensor the size of the expert weights per "
                 "projection, and reads it back, which split never does. This bench does not time that apart.")
    return text


def _span(values: list[tuple[float, int]]) -> str:
    """ "a× to b× (1024–16384 tokens, n points)" over (ratio, tokens) pairs."""
    rs, ts = sorted(v for v, _ in values), sorted(t for _, t in values)
    r = fmt.times(rs[0]) if len(rs) == 1 else f"{fmt.times(rs[0])} to {fmt.times(rs[-1])}"
    t = f"{ts[0]}" if ts[0] == ts[-1] else f"{ts[0]}–{ts[-1]}"
    return f"{r} ({t} tokens, {len(rs)} point{'s' if len(rs) > 1 else ''})"


def _seeds_table(points: list[RolePoint], model: str, seeds: dict, short: dict[str, str] | None = None) -> str:
    """The published table for one model, rebuilt: their two columns, then ours per GPU. A role with no
    row on a GPU the plan skips for the model (``short``: GPU -> why) says why, not "not run"."""
    mine = sorted((p for p in points if p.model == model), key=lambda p: (p.gpu_name, p.seq_len))
    lengths = sorted({p.seq_len for p in mine} | {int(t) for t in (seeds.get("unsloth") or {})})
    if not lengths:
        return ""
    gpus = sorted({p.gpu_name for p in mine})
    body = []
    for t in lengths:
        us, tr = (seeds.get("unsloth") or {}).get(str(t)), (seeds.get("transformers") or {}).get(str(t))
        row = [t, fmt.ms(fmt.number(us)), fmt.ms(fmt.number(tr)) if tr != "OOM" else "OOM",
               fmt.times(fmt.number(tr) / fmt.number(us)) if fmt.number(tr) and fmt.number(us) else "–"]
        for gpu in gpus:
            p = next((p for p in mine if p.gpu_name == gpu and p.seq_len == t), None)
            gap = (short or {}).get(gpu, "not run")
            row += [cell(p, r) if p and (r in p.rows or r in p.failed) else gap for r in ROLES]
        body.append(row)
    sg = seeds.get("gpu", "?")
    header = ["tokens", f"published Unsloth ({sg})", f"published Transformers v5 ({sg})", "published ratio"]
    header += [f"{ROLE_LABEL[r]}, {gpu}" for gpu in gpus for r in ROLES]
    return f"**{model}** (ms per step; ours with its speed-up over stock on the same GPU)\n\n" + other_run_note(fmt.table(header, body))


def _too_small(rows: list[dict], need: dict[str, float]) -> dict[str, dict[str, str]]:
    """model -> {GPU: why} for the GPUs the rows ran on whose memory is below what the plan's steps
    for that model ask (``min_gpu_gib``): there those steps are skipped, not pending."""
    memory = {gpu_short(name): have for name, have in gpu_memory_gib(rows).items()}
    return {m: {g: f"skipped (GPU < {gib:.0f} GiB)" for g, have in memory.items() if have and have < gib}
            for m, gib in need.items()}


def section(rows: list[dict], spec: dict, seeds: dict, fig_dir: Path, readme_dir: Path,
            min_gib: dict[str, float] | None = None) -> tuple[str, Headline]:
    """The MoE section. ``min_gib``: model -> the GPU memory the plan's steps for it ask for."""
    head = Headline("MoE: routing grouped once, grouped_mm experts, split LoRA",
                    "a host sync per expert, and peft materializing B·A for all E experts every step")
    seeds_ms = seeds.get("models") or {}
    head.seeds = "; ".join(f"{m}: {fmt.times(fmt.number(s['transformers'].get('2048')) / fmt.number(s['unsloth'].get('2048')))} at 2048 tokens ({s.get('gpu')})"
                           for m, s in seeds_ms.items() if fmt.number((s.get("transformers") or {}).get("2048")))
    if not rows:
        return "", head
    parts = ["## 3. MoE: routing grouped once, grouped_mm experts, split LoRA"]
    for text in (_syncs_md(rows), _routing_md(rows, spec.get("seeds_routing") or {})):
        if text:
            parts.append(text)
    q = [r for r in rows if r.get("kind") == "moe_query_model"]
    if fig := figures.predicted_vs_measured(
            [(gpu_short(r.get("device_name")), pred, fmt.number(r.get("measured_saving_ms")), False,
              str(r.get("tokens"))) for r, pred in predicted_from_other_lengths(q)],  # colour: the length
            fig_dir / "moe-predicted-vs-measured.png", "routing saving per layer (ms)"):
        parts.append("**Sorted over loop, predicted from the per-query cost.** Each of the loop's E dynamic "
                     "queries costs c = (loop − sorted)/(E − 1) on the routing path; (E − 1)·c predicts the "
                     "saving per layer at each token count, with c taken from the other token counts of the same "
                     "model and GPU (their median), so no point is predicted from its own measurement.\n\n"
                     + embed(fig, "MoE routing: predicted against measured saving", readme_dir))
    if cross := _crossover_md(rows):
        parts.append(cross)
    rp = role_points(rows)
    short = _too_small(rows, min_gib or {})
    for model in sorted({p.model for p in rp}, key=fmt.natural):
        parts.append(_seeds_table(rp, model, seeds_ms.get(model, {}), short.get(model)))
    if caveat := stock_caveats(rp):
        parts.append(caveat)
    if fig := figures.speedup_vs_length(rp, fig_dir / "moe-speedup.png", "step time"):
        parts.append(embed(fig, "MoE: speed-up over stock by length", readme_dir))
    heads = [p for p in rp if p.seq_len == 2048]
    if table := split_table(heads):
        parts.append("### Where the time and memory go (2048 tokens)\n\n" + table)
    limits = []
    for model in sorted({p.model for p in rp}, key=fmt.natural):
        for gpu in sorted({p.gpu_name for p in rp}):
            pairs = {p.seq_len: {"stock": p.ms("stock"), "ours": p.ms("best")} for p in rp
                     if p.model == model and p.gpu_name == gpu}
            if text := moe_gap_md(pairs, f"{model}, {gpu}"):
                limits.append(text)
    if limits:
        parts.append("### Where the ratio stops growing\n\n" + "\n\n".join(limits))
    for gpu in sorted({p.gpu_name for p in rp}):
        # per model, the one call against the fastest other over every length it ran; where it never
        # ran, the best setting's range over stock, named, as it is beyond the defaults
        at = []
        for model in sorted({p.model for p in rp if p.gpu_name == gpu}, key=fmt.natural):
            mine = [p for p in rp if p.gpu_name == gpu and p.model == model]
            user = [(r, p.seq_len) for p in mine if (r := p.over_fastest_peer()[0])]
            if user:
                missing = sorted({ROLE_LABEL[r] for p in mine if p.over_fastest_peer()[0]
                                  for r in PEERS if r not in p.peers_run()})
                at.append(f"{model}: enable() {_span(user)} the fastest other"
                          + (f" that ran ({', '.join(missing)} not run)" if missing else ""))
            elif best := [(s, p.seq_len) for p in mine if (s := p.speedup("best"))]:
                at.append(f"{model}: {_span(best)} over stock with ours' best setting (beyond the defaults)")
        if at:
            head.measured[gpu] = "; ".join(at)
    return "\n\n".join(p for p in parts if p), head


def part(rows: list[dict], spec: dict, ctx) -> tuple[str, Headline]:
    """Its part of the blog (harness.measured)."""
    return section(rows, spec, ctx.plan.seeds.get("moe", {}), ctx.fig_dir, ctx.reports_root, ctx.plan.min_gib())
