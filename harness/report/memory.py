"""``python -m harness.bench.memory``'s rows: where one step's memory peak goes."""

from __future__ import annotations

from harness.report import fmt


def _settings(r: dict) -> str:
    s = r.get("settings") or {}
    what = ", ".join(f"{k}={v}" for k, v in sorted(s.items()))
    return f"`optim.enable(model{', ' + what if what else ''})`" if r.get("stack") == "user" else "stock"


def bench_tables(rows: list[dict], spec: dict) -> str:
    """Per measured step: its peak above the step's start (the allocator's, and the replay's that
    the sites add up to), the phase it came in, and the sites holding it."""
    mine = [r for r in rows if r.get("kind") == "memory_peak"]
    if not mine:
        return ""
    parts = ["#### Where the step's memory peak goes",
             "One step recorded with the CUDA caching allocator's memory history after a warm-up, and "
             "replayed: the tensors live at the step's peak, above what the step started with (weights, "
             "adapters, optimizer state), grouped by the code that allocated them (innermost frames of the "
             "model, the adapters, optim and inductor's generated graphs): `python -m harness.bench.memory`."]
    for r in sorted(mine, key=lambda r: (fmt.natural(str(r.get("model"))), int(r.get("seq_len") or 0),
                                         int(r.get("doc_len") or 0), _settings(r))):
        doc = f", documents of {r['doc_len']}" if r.get("doc_len") else ", one document"
        head = f"**{r.get('model')}, {r.get('seq_len')} tokens{doc}, {_settings(r)}**"
        if r.get("status") != "ok":
            parts += [head, f"{r.get('status')}: {r.get('message') or ''}".strip()]
            continue
        parts.append(f"{head}: the step's peak is {fmt.num(r.get('step_peak_gib'), '.2f')} GiB above its start "
                     f"of {fmt.num(r.get('start_gib'), '.2f')} GiB (the allocator's); replayed "
                     f"{fmt.num(r.get('replayed_peak_gib'), '.2f')} GiB, "
                     f"{fmt.num(r.get('peak_kib_per_token'), '.1f')} KiB a token, in the {r.get('phase') or 'step'}.")
        body = [[f"`{g.get('site')}`", fmt.num(g.get("gib"), ".3f"), fmt.num(g.get("kib_per_token"), ".1f"),
                 fmt.num(g.get("blocks"), "d")] for g in r.get("groups") or []]
        parts.append(fmt.table(["allocated by", "GiB", "KiB a token", "blocks"], body))
    return "\n\n".join(parts)
