"""The longest trainable length per model and stack, from ``python -m harness context``'s probes.

Each probe is a step row at one length (``harness.run.context``): ``ok`` trained, ``oom`` or a
timed-out ``error`` did not. Only running out of memory bounds a verdict: a probe past the point's
time limit is the harness's limit, not the card's (the search bisects below it all the same), so a
variant stopped by one has a lower bound only, as one stopped on time or at a skipped probe. Per GPU type and model, a table gives each variant's longest length
that trained, the shortest above it that did not, and the probe's step time, tokens/s, peak and
the host memory its offloaded checkpoints held, and the host's memory in use at its peak (every
process's, sampled by the sweep; a probe the kernel's OOM killer ended is ``oom, host``). Peers are the variants of roles ``stock``,
``stock-compiled``, ``peer`` and ``unsloth``; ours are the rest.

``[report.context]`` may list ``targets``, each ``{model}`` with any of ``min_over_best_peer``
(ours' longest over the best peer's, on the same card), ``faster_at_peer_longest = true`` (ours'
step at the best peer's longest length is faster than that peer's: judged where ours has a row at
that length) and ``fits = N`` (ours trains at N tokens).

Where a variant's offloader was profiled (``offload_profile = true``), a second table gives, at its
longest length, the layer inputs reloaded (n), the median reload (c) and layer backward (g), and
the bound (n−1)·min(c, g) on what double buffering hides.

With the report's folder (``out_dir``), each GPU type gets a bar chart of those longest lengths
(a panel per model, a bar per variant in its role's colour, a cross at the shortest length that did
not train). Step time against length, per variant, is the per-GPU step-time figure of the report.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from harness.report import fmt, plots
from harness.report.palette import ROLE_COLOR, ROLE_LABEL
from harness.roles import OURS, role_of
from harness.run.context import FAILS, HEADROOM, TRAINS, outcomes, peaks, predict, stack_cap

PEER_ROLES = ("stock", "stock-compiled", "peer", "unsloth")
DASH_NOT_REACHED = "none probed"
FILLED = 0.85  # of the card: a longest probe that held this much is projected no further (``projected``)


def by_variant(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(gpu slug, model, variant) -> that variant's probes."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r.get("gpu_slug") or "unknown", r.get("model"), r.get("variant")), []).append(r)
    return out


def longest(rows: list[dict]) -> tuple[dict | None, int | None, str]:
    """Of one variant's probes on one GPU type: the row at the longest length that trained, the
    shortest length above it that did not, and that probe's status ("" where none). A length that
    ran out of memory or time is preferred to a skipped or failed one (Unsloth past the model's
    positions), which only ended the search. What bounds a verdict is ``_oom_above``'s."""
    seen = outcomes(rows, rows[0].get("model"), rows[0].get("variant"), None)
    ok = [n for n, st in seen.items() if st in TRAINS]
    best = max(ok, default=None)
    higher = [n for n, st in seen.items() if st not in TRAINS and (best is None or n > best)]
    above = min((n for n in higher if seen[n] in FAILS), default=min(higher, default=None))
    at_best = [r for r in rows if best is not None and int(r["seq_len"]) == best and r.get("status") == "ok"]
    row = max(at_best, key=lambda r: str(r.get("recorded_at") or ""), default=None)  # the newest probe there
    return row, above, (seen[above] if above is not None else "")


def _oom_above(rows: list[dict], best: int | None) -> int | None:
    """The shortest length above ``best`` (any length where None) whose probe ran out of memory:
    the only probe that bounds a variant's longest, whatever timed out below it."""
    seen = outcomes(rows, rows[0].get("model"), rows[0].get("variant"), None)
    return min((n for n, st in seen.items() if st == "oom" and (best is None or n > best)), default=None)


def _host_gib(row: dict | None) -> float | None:
    host = ((row or {}).get("offload_stats") or {}).get("host_buffer_bytes")
    return host / 2**30 if host else None


def _host_cell(row: dict | None) -> str:
    """The host memory a probe's offloaded checkpoints held, and of how much the host has."""
    held, total = _host_gib(row), ((row or {}).get("env") or {}).get("host_memory_gib")
    if not held:
        return fmt.DASH
    return f"{held:.2f}" + (f" of {total:.1f}" if total else "")


def _above_cell(rows: list[dict], above: int | None, why: str, best: dict | None = None) -> str:
    """The shortest length above the longest that did not train, and why: ``oom, host`` where the
    kernel's OOM killer ended the probe (``memory_bound``), with the host's memory in use at its
    sampled peak (every process's, read every ``harness.measure.host.INTERVAL_S``: the last moment
    before the kill may be missed). A variant that trained at its stack's limit (``stack_cap``)
    goes no further whatever its probes past it say: that limit is the cell."""
    cap = _cap(rows)
    if best is not None and cap is not None and int(best["seq_len"]) >= cap:
        return f"none: its limit, the model's {cap} positions"
    if above is None:
        return DASH_NOT_REACHED
    row = _failed_at(rows, above)
    if row.get("memory_bound") == "host":
        used, total = row.get("host_used_peak_gib"), (row.get("env") or {}).get("host_memory_gib")
        why = "oom, host" + (f": sampled peak {used:.1f} of {total:.1f} GiB in use" if used and total else "")
    return f"{above} ({why})"


def _failed_at(rows: list[dict], n: int) -> dict:
    """The newest probe at length ``n`` that did not train ({} where none)."""
    at = [r for r in rows if int(r["seq_len"]) == n and r.get("status") != "ok"]
    return max(at, key=lambda r: str(r.get("recorded_at") or ""), default={})


def projected(rows: list[dict], row: dict | None) -> int | None:
    """Where a variant's longest is not bounded (no probe above it ran out of memory): the length
    at which the line through the peaks of its two longest lengths that trained, measured by the
    code of ``row``, fills ``HEADROOM`` of the card (``harness.run.context.predict``, where its
    search would probe next). A projection, not a measurement; None where it is bounded, two
    peaks are lacking, a probe above it failed otherwise (an error, not a timeout) or was refused
    (skipped), the projection is past its stack's limit (``stack_cap``), or the longest
    already held ``FILLED`` of the card: a stack that keeps what
    memory allows (``recompute="auto"``) fills the card at every length, and no line extends it."""
    if row is None or _oom_above(rows, int(row["seq_len"])) is not None:
        return None
    seen = outcomes(rows, row.get("model"), row.get("variant"), None)
    if any(st in ("error", "skipped") for n, st in seen.items() if n > int(row["seq_len"])):
        # a probe above died (killed, crashed) or was refused (Unsloth past the model's positions):
        # no line goes past it, bound or not
        return None
    code = (row.get("env") or {}).get("code_id")
    got, capacity = peaks(rows, row.get("model"), row.get("variant"), code)
    if capacity and got.get(int(row["seq_len"]), 0) >= FILLED * capacity:
        return None
    n = predict(got, capacity)
    cap = _cap(rows)
    if cap is not None and n is not None and n > cap:
        return None  # its stack stops at the model's positions before the card fills
    return n if n is not None and n > int(row["seq_len"]) else None


def _projection_note(projections: list[tuple[str, str, dict, int]]) -> str:
    """A sentence on the projected lengths, and what offload would hold of the host there."""
    host = []
    for model, variant, row, n in projections:
        held = _host_gib(row)
        if held:
            total = (row.get("env") or {}).get("host_memory_gib")
            host.append(f"`{variant}` ({model}) {held * n / int(row['seq_len']):.1f} GiB at {n:,} tokens"
                        + (f", of the host's {total:.1f} GiB" if total else " (the host's memory not recorded)"))
    text = (f"\"card full at\" extends, where no probe above the longest ran out of memory or died, the line through the "
            f"peaks of the two longest lengths that trained to {HEADROOM:.0%} of the card (where the search would "
            "probe next): a projection from two rows, not a measurement; attention or any other part that grows "
            "faster than the length makes it long.")
    if host:
        text += (" Offloaded checkpoints grow with the length, so at that length they would hold: "
                 + "; ".join(host) + ".")
    return text


def offload_bound(row: dict | None) -> dict | None:
    """Of a probe whose offloader was profiled (``offload_profile``): n, the layer inputs reloaded
    in its last step; c and g, the median reload and layer backward (recompute + backprop); and
    (n−1)·min(c, g), what double buffering can hide of the reloads. None where not profiled."""
    st = (row or {}).get("offload_stats") or {}
    reload, backward = st.get("reload_ms") or [], st.get("backward_ms") or []
    if not reload or not backward:
        return None
    c, g = sorted(reload)[len(reload) // 2], sorted(backward)[len(backward) // 2]
    n = len(reload)
    return {"n": n, "c_ms": c, "g_ms": g, "bound_ms": (n - 1) * min(c, g)}


def _bound_table(rows: list[tuple[str, str, dict]]) -> str:
    """Per profiled probe at its longest length: the host memory offload held and the bound."""
    body = []
    for model, variant, row in rows:
        b = offload_bound(row)
        step = fmt.stat(row, "step_ms")
        body.append([model, variant, row["seq_len"], fmt.num(_host_gib(row), ".2f"), b["n"], fmt.ms(b["c_ms"]),
                     fmt.ms(b["g_ms"]), fmt.ms(b["bound_ms"]), fmt.ms(step),
                     fmt.num(100 * b["bound_ms"] / step, ".1f") + " %" if step else fmt.DASH])
    return ("Offload at the longest length: n layer inputs reloaded from pinned host memory, c the median reload "
            "and g the median layer backward (recompute + backprop), both timed with CUDA events in the probe's "
            "last step; (n−1)·min(c, g) is what the second staging buffer can hide of the reloads.\n\n"
            + fmt.table(["model", "variant", "tokens", "host GiB", "n", "c ms", "g ms", "(n−1)·min(c,g) ms",
                         "step ms", "bound / step"], body))


def lead(steps: list[dict], rows: list[dict], spec: dict, out_dir: Path | None = None) -> str:
    groups = by_variant(steps)
    if not groups:
        return ""
    parts = ["## The longest trainable length per stack",
             "Each stack's longest single-document length that trained one full step (forward, backward, "
             "AdamW), searched by `python -m harness context`: doubling, then bisection; each probe one fresh "
             "process. Step time, tokens/s and peak are the probe's at that length (its few measured steps); "
             "\"host in use\" is the host's memory in use at its peak while that probe ran (every process's, read "
             "by the sweep process), and a probe the kernel's OOM killer ended ran the host, not the card, out of "
             "memory (\"oom, host\")."]
    for slug in sorted({k[0] for k in groups}):
        body, profiled, projections = [], [], []
        for (g, model, variant), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if g != slug:
                continue
            row, above, why = longest(rs)
            if offload_bound(row):
                profiled.append((model, variant, row))
            if (n := projected(rs, row)) is not None:
                projections.append((model, variant, row, n))
            body.append([model, variant, role_of(rs[0]), row["seq_len"] if row else "none",
                         _above_cell(rs, above, why, row),
                         f"{n:,} (projected)" if n is not None else fmt.DASH, fmt.ms(fmt.stat(row, "step_ms")),
                         fmt.num((row or {}).get("tokens_per_s"), ",.0f") if row else fmt.DASH,
                         fmt.num((row or {}).get("peak_allocated_gib"), ".2f") if row else fmt.DASH,
                         _host_cell(row), fmt.num((row or {}).get("host_used_peak_gib"), ".1f"), len(rs)])
        parts.append(f"### {fmt.distinct(r.get('device_name') for r in steps if r.get('gpu_slug') == slug)}")
        parts.append(fmt.table(["model", "variant", "role", "longest trained", "shortest that did not",
                                "card full at", "step ms", "tokens/s", "peak GiB", "offloaded GiB (host)",
                                "host in use GiB", "probes"], body))
        if projections:
            parts.append(_projection_note(projections))
        if profiled:
            parts.append(_bound_table(profiled))
        if out_dir is not None and (path := plot_longest({k: rs for k, rs in groups.items() if k[0] == slug},
                                                         Path(out_dir) / f"{slug}-context-longest.png")):
            parts.append(plots.embed_figure(path, f"longest trained length per variant ({slug})"))
    targets = spec.get("targets") or []
    if targets:
        parts.append(targets_md(groups, targets))
    return "\n\n".join(parts)


def bounds(groups: dict, keys: list[tuple]) -> tuple[int | None, float | None]:
    """What the probes of these variants prove about the longest of them: at least the longest
    length one trained, and at most one under the shortest length above it that ran out of memory
    (``_oom_above``), or its stack's limit where it trained there (Unsloth at the model's
    positions: ``stack_cap``), infinite where a variant has neither (unfinished, stopped at
    ``max_len``, or by timed-out, skipped or failed probes: a lower bound only, or none). Variants
    that neither trained, ran out of memory nor timed out (unavailable, refused) bound nothing;
    (None, None) where none is left."""
    lo, up = None, None
    for k in keys:
        row, above, why = longest(groups[k])
        best = int(row["seq_len"]) if row is not None else None
        oom = _oom_above(groups[k], best)
        if row is None and oom is None and why != "timeout":  # never ran (unavailable, refused): no bound
            continue
        if best is not None:
            lo = max(lo or 0, best)
        cap = _cap(groups[k])
        if cap is not None and best is not None and best >= cap:
            bound = cap  # trained at its stack's limit, the model's positions (``stack_cap``): as far as it goes
        elif oom is not None:
            bound = oom - 1
        else:
            bound = float("inf")
        up = max(up or 0, bound)
    return lo, up


def _cap(rows: list[dict]) -> int | None:
    """The stack's limit on the length of one variant's probes (``harness.run.context.stack_cap``)."""
    return stack_cap(rows[0].get("model"), rows[0].get("stack"))


def window_note(groups: dict, peers: list[tuple], ours: list[tuple]) -> str:
    """Where the best of ``peers`` trained at its stack's limit (Unsloth at the model's positions,
    past which its loader rescales RoPE: ``stack_cap``) and ours trained past it, what that ratio
    compares: a stack's refusal against ours' memory, not two full cards. "" otherwise."""
    def reach(keys):  # (variant, longest trained, its stack's limit) of each variant that trained
        return [(k[2], int(row["seq_len"]), _cap(groups[k])) for k in keys if (row := longest(groups[k])[0])]

    peer_reach = reach(peers)
    at_cap = [(v, cap) for v, n, cap in peer_reach if cap is not None and n >= cap]
    limit = max((cap for _, cap in at_cap), default=None)
    o_len = max((n for _, n, _ in reach(ours)), default=0)
    if limit is None or max(n for _, n, _ in peer_reach) > limit or o_len <= limit:
        return ""
    names = sorted(f"`{v}`" for v, _ in at_cap)
    verb = "stops" if len(names) == 1 else "stop"
    return (f"{', '.join(names)} {verb} at the model's {limit} positions (its loader would rescale RoPE "
            "past them), not at a full card; ours trains past the model's context window, its RoPE as configured")


def ratio_shown(o_len: int, p_len: int, p_up: float | None) -> tuple[str, str]:
    """Ours' longest trained over the peers' longest, and the peers' length, as their probes bound
    it (``bounds``: at least ``p_len``, at most ``p_up``): one figure ("2.00×", "32768") where
    that bracket does not move the ratio at two decimals, else a range from the peers' upper bound
    to their longest trained ("1.60× to 2.00×", "32768 to 40959"), even for a search bisected to
    its resolution, so the figure is never the peers' best case read as settled. Ours' own bracket
    is left to the text beside it ("ours could go longer")."""
    high = fmt.times(o_len / p_len)
    low = fmt.times(o_len / p_up) if p_up and p_up != float("inf") else high
    if low == high:
        return high, str(p_len)
    return f"{low} to {high}", f"{p_len} to {int(p_up)}"


def _verdict(low: float | None, high: float, goal: float) -> str:
    """Met where the lower bound reaches the goal, not met where the upper bound falls short of it,
    else not yet known (a search not finished to the precision the goal needs)."""
    if low is not None and low >= goal:
        return fmt.met(True)
    if high < goal:
        return fmt.met(False)
    return "not yet known"


def targets_md(groups: dict, targets: list[dict]) -> str:
    """Each target judged from what the searches prove (``bounds``): a verdict only where the
    probes settle it, "not yet known" where a search would have to go on."""
    body = []
    for slug in sorted({k[0] for k in groups}):
        for t in targets:
            model = t.get("model")
            mine = {v: longest(rs) for (g, m, v), rs in groups.items() if g == slug and m == model}
            peers = {v: x for v, x in mine.items() if role_of(groups[(slug, model, v)][0]) in PEER_ROLES}
            ours = {v: x for v, x in mine.items() if role_of(groups[(slug, model, v)][0]) in OURS}
            # the peer that trains longest; of peers tied there, the fastest
            best_peer = max(peers, key=lambda v: (int(peers[v][0]["seq_len"]), -(fmt.stat(peers[v][0], "step_ms") or 0))
                            if peers[v][0] else (0, 0), default=None)
            best_ours = max(ours, key=lambda v: int(ours[v][0]["seq_len"]) if ours[v][0] else 0, default=None)
            p_len, p_up = bounds(groups, [(slug, model, v) for v in peers])
            o_len, o_up = bounds(groups, [(slug, model, v) for v in ours])
            where = f"{model} ({slug})"
            # a peer role with no probe here was not searched (a probe it skipped, saying why, was):
            # the best peer may be that one, so a verdict it could overturn is not given
            searched = {role_of(groups[(slug, model, v)][0]) for v in peers}
            missing = [ROLE_LABEL.get(r, r) for r in PEER_ROLES if r not in searched]
            unsearched = f"; not searched: {', '.join(missing)}" if missing else ""
            if "min_over_best_peer" in t:
                goal = t["min_over_best_peer"]
                ratio = o_len / p_len if o_len and p_len else None
                if ratio:
                    times, peer_len = ratio_shown(o_len, p_len, p_up)
                    shown = f"{times} ({o_len} `{best_ours}` vs {peer_len} `{best_peer}`)"
                else:
                    shown = "not measured"
                open_ended = [who for who, up in (("ours", o_up), ("the peers'", p_up)) if up == float("inf")]
                if ratio and open_ended:
                    shown += f"; {' and '.join(open_ended)} could go longer: no probe above ran out of memory"
                died = sorted(f"`{v}` at {x[1]}: {_failed_at(groups[(slug, model, v)], x[1]).get('message') or 'no message'}"
                              for v, x in mine.items() if x[2] == "error")
                if ratio and died:  # a death is no bound, but the reader should know the search met one
                    shown += f" (a probe above died, which bounds nothing: {'; '.join(died)})"
                timed = sorted(f"`{v}` at {x[1]}" for v, x in mine.items() if x[2] == "timeout")
                if ratio and timed:
                    shown += f" (timed out, the point's time limit: {', '.join(timed)})"
                verdict = _verdict(o_len / p_up if o_len and p_up else None, o_up / p_len, goal) if ratio else fmt.DASH
                note = window_note(groups, [(slug, model, v) for v in peers], [(slug, model, v) for v in ours])
                if ratio and note:
                    shown += f"; {note}"
                if ratio and missing:  # a peer not searched can only raise the best peer's length
                    shown += unsearched
                    verdict = verdict if verdict == fmt.met(False) else "not yet known"
                body.append([f"ours' longest ≥ {goal}× the best peer's, {where}", shown, verdict])
            if t.get("faster_at_peer_longest"):  # ours' fastest row at that length
                at = min((r for v in ours for r in groups[(slug, model, v)] if p_len and int(r["seq_len"]) == p_len
                          and r.get("status") == "ok" and fmt.stat(r, "step_ms")),
                         key=lambda r: fmt.stat(r, "step_ms"), default=None)
                peer_ms = fmt.stat(peers[best_peer][0], "step_ms") if best_peer and peers[best_peer][0] else None
                ours_ms = fmt.stat(at, "step_ms")
                shown = f"{fmt.ms(ours_ms)} vs {fmt.ms(peer_ms)} ms at {p_len}" if ours_ms and peer_ms else "not measured"
                settled = p_up != float("inf")  # the peers' longest is known, not only a lower bound
                if ours_ms and peer_ms and not settled:
                    shown += ("; a peer's search went no further (no probe above ran out of memory), so the peers' "
                              "longest is not known yet")
                # a probe without a warm-up step timed its first step: compiling and autotuning included
                cold = [r for r in (at, peers[best_peer][0] if best_peer else None) if r and r.get("warmup_steps") == 0]
                if ours_ms and peer_ms and cold:
                    shown += ("; timed without a warm-up step (the first step, compiling included): "
                              + ", ".join(f"`{r.get('variant')}`" for r in cold))
                if ours_ms and peer_ms and missing:
                    shown += unsearched
                body.append([f"ours faster than the best peer at its longest length, {where}", shown,
                             (fmt.met(ours_ms < peer_ms) if settled and not cold and not missing else "not yet known")
                             if ours_ms and peer_ms else fmt.DASH])
            if "fits" in t:
                n = int(t["fits"])
                probed = o_len or o_up is not None  # or ran out of memory or time at its first length
                body.append([f"ours trains at {n} tokens, {where}",
                             (f"longest {o_len}" if o_len else "trained at no length probed") if probed else "not measured",
                             _verdict(o_len, o_up, n) if probed else fmt.DASH])
    return "Targets:\n\n" + fmt.table(["target", "measured", "met?"], body)


def plot_longest(groups: dict[tuple, list[dict]], path: Path) -> Path | None:
    """One GPU type's probes (``(slug, model, variant) -> rows``): per model a panel, per variant a
    bar to its longest trained length (log 2 axis), coloured by role, with a cross at the shortest
    length above it that did not train (or, for a variant that trained at no length, at the
    shortest it tried). Models where no variant trained get no panel; None where none did."""
    found = {(m, v): (role_of(rs[0]), *longest(rs)) for (_, m, v), rs in groups.items()}
    models = sorted({m for (m, _), x in found.items() if x[1] is not None})
    if not models:
        return None
    fig = Figure(figsize=(6 * len(models), 0.5 + 0.45 * max(sum(1 for k in found if k[0] == m) for m in models)))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        names = sorted((v for m, v in found if m == model), reverse=True)
        for i, v in enumerate(names):
            role, row, above, _ = found[(model, v)]
            color = ROLE_COLOR.get(role, ROLE_COLOR["best"] if role == "ours" else "#bcbd22")
            if row is not None:
                n = int(row["seq_len"])
                ax.barh(i, n, color=color, height=0.6, label=ROLE_LABEL.get(role, role or "no role"))
                ax.text(n, i, f" {n:,}", va="center", fontsize=8)
            if above is not None:
                ax.plot([above], [i], marker="x", color="#d62728", linestyle="none",
                        label="the shortest length that did not train")
        ax.set_xscale("log", base=2)
        drawn = [int(found[(model, v)][1]["seq_len"]) for v in names if found[(model, v)][1] is not None]
        drawn += [found[(model, v)][2] for v in names if found[(model, v)][2] is not None]
        ax.set_xlim(left=min(drawn) / 2)  # bars on a log axis start somewhere: half the shortest drawn
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x):,}"))
        ax.set_yticks(range(len(names)), names)
        ax.set_title(model)
        ax.set_xlabel("longest trained length (tokens, one document)")
        ax.grid(True, axis="x", which="both", alpha=0.3)
    plots.legend_below(fig, axes, ncol=1)
    return plots.save_figure(fig, path)
