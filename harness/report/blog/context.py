"""The long-context section: per GPU and model, each stack's longest trainable single-document
length, what optim needs to get there, and the targets, as far as the probes settle them."""

from __future__ import annotations

from harness.report import context as report
from harness.report import fmt
from harness.report.blog.common import Headline
from harness.report.blog.style import gpu_short
from harness.report.palette import ROLE_LABEL
from harness.roles import OURS, role_of


def _claim(groups: dict, slug: str, model: str) -> str | None:
    """Ours' longest against the best peer's, as the probes bound them: "ours 262144 vs the best
    peer's 262144 (both could go longer)"."""
    keys = [k for k in groups if k[0] == slug and k[1] == model]
    ours = [k for k in keys if role_of(groups[k][0]) in OURS]
    peers = [k for k in keys if role_of(groups[k][0]) in report.PEER_ROLES]
    o_len, o_up = report.bounds(groups, ours)
    p_len, p_up = report.bounds(groups, peers)
    if not o_len or not p_len:
        return None
    open_ = [who for who, up in (("ours", o_up), ("the peers'", p_up)) if up == float("inf")]
    searched = {role_of(groups[k][0]) for k in peers}
    missing = [ROLE_LABEL.get(r, r) for r in report.PEER_ROLES if r not in searched]
    times, peer_len = report.ratio_shown(o_len, p_len, p_up)
    peer = f"the best peer's {peer_len} ({times})"
    note = report.window_note(groups, peers, ours)
    return (f"{model}: ours {o_len} tokens vs {peer}"
            + (f"; {note}" if note else "")
            + (f"; {' and '.join(open_)} not yet bounded" if open_ else "")
            + (f"; not searched: {', '.join(missing)}" if missing else ""))


def _ranks(groups: dict) -> str:
    """The LoRA ranks the probes trained, per model: "r=16 for llama-3.1-8b and qwen3-8b-yarn, r=64
    for gpt-oss-20b"."""
    by_rank: dict = {}
    for (_, model, _), rs in groups.items():
        by_rank.setdefault(rs[0].get("lora_rank"), set()).add(model)
    return ", ".join(f"r={r} for {' and '.join(sorted(ms))}"
                     for r, ms in sorted(by_rank.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def _call(row: dict) -> str:
    """The ``optim.enable`` call a row of ours ran, from its switches."""
    from harness.variant_keys import optim_settings

    flat = {k: v for per in optim_settings(row.get("switches") or {}).values() for k, v in per.items()}
    return "`optim.enable(model" + "".join(f", {k}={v!r}" for k, v in sorted(flat.items())) + ")`"


def part(rows: list[dict], spec: dict, ctx) -> tuple[str, Headline]:
    """Its part of the blog (harness.measured)."""
    head = Headline("Long context: checkpoints in pinned host memory, MLPs in chunks, causal attention",
                    "activations that grow with the length until the card is full")
    groups = report.by_variant([r for r in rows if r.get("kind", "step") == "step"])
    if not groups:
        return "", head
    exps = sorted({r["experiment"] for rs in groups.values() for r in rs if r.get("experiment")}) or ["context"]
    parts = ["## 4. Long context on one GPU",
             "The longest single-document length each stack trains one full step at (forward, backward, "
             f"AdamW; bf16 LoRA, {_ranks(groups)}), searched by `python -m harness context`: "
             "doubling, then toward where the peaks of the lengths that trained say the card fills, then "
             "bisection, each probe a fresh process; an out-of-memory probe is the only one that bounds a "
             "length from above. Every table, step time and the offload bound at each length: "
             + ", ".join(f"[reports/{e}]({e}/README.md)" for e in exps) + "."]
    ran: dict = {}  # each call of ours, with the models it ran on
    for k, rs in groups.items():
        if role_of(rs[0]) in OURS:
            ran.setdefault((k[2], _call(rs[0])), set()).add(k[1])
    calls = sorted(f"`{v}` ({', '.join(sorted(ms))}): {call}" for (v, call), ms in ran.items())
    if calls:
        parts.append("Ours, as each row ran it: " + "; ".join(calls) + ".")
    for slug in sorted({k[0] for k in groups}):
        gpu = gpu_short(next(r.get("device_name") for rs in groups.values() for r in rs if r.get("gpu_slug") == slug))
        body = []
        for (g, model, variant), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if g != slug:
                continue
            row, above, why = report.longest(rs)
            host = ((row or {}).get("offload_stats") or {}).get("host_buffer_bytes")
            body.append([model, f"`{variant}`", role_of(rs[0]), row["seq_len"] if row else "none",
                         f"{above} ({why})" if above else report.DASH_NOT_REACHED,
                         fmt.num((row or {}).get("peak_allocated_gib"), ".2f") if row else fmt.DASH,
                         fmt.num(host / 2**30, ".2f") if host else fmt.DASH])
        parts += [f"### {gpu}", fmt.table(["model", "stack", "role", "longest trained", "shortest that did not",
                                           "peak GiB", "host GiB (offload)"], body)]
        claims = [c for m in sorted({k[1] for k in groups if k[0] == slug}) if (c := _claim(groups, slug, m))]
        if claims:
            head.measured[gpu] = "; ".join(claims)
    if spec.get("targets"):
        parts.append("Its targets are judged under \"Targets: met or not\", "
                     + " and ".join(f"`{e}`" for e in exps) + ".")
    return "\n\n".join(parts), head
