"""MoE: the layer benchmark's routing and LoRA tables, the end-to-end comparison with stock and
the published figures, and what would make the largest model fit."""

from __future__ import annotations

from harness.report.fmt import DASH
from harness.report import fmt
from harness.report.moe_query import query_model_md
from harness.report.moe_syncs import syncs_md
from harness.report.runs import SAME_RUN_MINUTES, run_label, split_runs
from harness.roles import is_ours, role_of
from harness.variant_keys import SWITCHES

# the backends the layer benchmark compares: every choice of the switch but "auto"
MOE_BACKENDS = tuple(b for b in SWITCHES["moe_backend"].choices if b != "auto")
# ---------------------------------------------------------------------------------------------
# MoE layer (bench_moe)


def rows_of_kind(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r["kind"] == kind]


def moe_routing(rows: list[dict]) -> list[dict]:
    """Per (model, tokens): p50 fwd/bwd ms per backend and sorted over loop (%, steps/s sense)."""
    points: dict[tuple, dict] = {}
    for r in rows_of_kind(rows, "moe_routing"):
        key = (str(r.get("model") or "unknown"), int(fmt.number(r.get("tokens")) or 0))
        points.setdefault(key, {"model": key[0], "tokens": key[1], "backends": {}})["backends"][r.get("backend")] = r
    out = []
    for key in sorted(points, key=lambda k: (fmt.natural(k[0]), k[1])):
        pt = points[key]
        b = pt["backends"]
        for metric in ("forward_ms", "backward_ms"):
            pt[f"sorted_over_loop_{metric}"] = fmt.gain_pct(fmt.stat(b.get("loop"), metric), fmt.stat(b.get("sorted"), metric))
        out.append(pt)
    return out


def gain_cell(pct) -> str:
    """A percent gain, with the ratio beside it when it is large enough that % reads badly."""
    if fmt.number(pct) is None or pct < 100:
        return fmt.signed_pct(pct)
    return fmt.Cell(f"{fmt.signed_pct(pct)} ({1 + pct / 100:.2f}×)", pct)


def _fwd_bwd(row: dict | None) -> str:
    if row and row.get("status") not in (None, "ok"):
        return str(row.get("status")).upper()
    return fmt.joined(" / ", fmt.ms(fmt.stat(row, 'forward_ms')), fmt.ms(fmt.stat(row, 'backward_ms')))


def moe_tables(rows: list[dict]) -> str:
    parts = []
    routing = moe_routing(rows)
    if routing:
        body = [[pt["model"], pt["tokens"], *(_fwd_bwd(pt["backends"].get(b)) for b in MOE_BACKENDS),
                 gain_cell(pt["sorted_over_loop_forward_ms"]), gain_cell(pt["sorted_over_loop_backward_ms"])] for pt in routing]
        header = ["model", "tokens", *(f"{b} fwd / bwd ms" for b in MOE_BACKENDS), "sorted over loop fwd",
                  "sorted over loop bwd"]
        parts.append("#### MoE routing path (group, gather, weight, scatter; no expert GEMMs)\n\n"
                     + fmt.table(header, body) + "\n\np50 of CUDA-event timings; \"sorted over loop\" = "
                     "100·(loop / sorted − 1), + = sorted faster.")
    if syncs := syncs_md(rows_of_kind(rows, "moe_syncs")):
        parts.append(syncs)
    if query := query_model_md(rows):
        parts.append(query)
    if crossover := moe_crossover_md(rows):
        parts.append(crossover)
    return "\n\n".join(parts)


CROSSOVER_HEADER = ["model", "tokens", "r", "s* tokens gate_up / down", "LoRA GFLOP merged → split",
                    "experts layer fwd+bwd ms merged → split (backend)", "split speed-up"]
CROSSOVER_NOTE = ("s* = E·m·n / (k·(m+n)) · (1 + 1/(2r)) per projection: below s* routed tokens split LoRA "
                  "(X·A_e)·B_e costs fewer FLOPs than peft's materialized W + B·A for all E experts.")


def moe_crossover_md(rows: list[dict]) -> str:
    """The split-LoRA crossover table of one GPU's rows (CROSSOVER_HEADER's columns)."""
    body = moe_crossover_body(rows)
    if not body:
        return ""
    return "#### Split LoRA crossover\n\n" + fmt.table(CROSSOVER_HEADER, body) + "\n\n" + CROSSOVER_NOTE


def moe_crossover_points(rows: list[dict]) -> list[dict]:
    """Per (model, tokens): s* per projection, the LoRA FLOPs and the experts layer's fwd+bwd ms,
    merged against split, on the fastest backend that ran split."""
    cross = rows_of_kind(rows, "moe_split_crossover")
    experts = {(r.get("model"), r.get("tokens"), r.get("backend"), r.get("lora")): r for r in rows_of_kind(rows, "moe_experts")}
    groups: dict[tuple, dict] = {}
    for r in cross:
        groups.setdefault((str(r.get("model") or "unknown"), int(fmt.number(r.get("tokens")) or 0)), {})[r.get("projection")] = r
    out = []
    for (model, tokens), projs in sorted(groups.items(), key=lambda kv: (fmt.natural(kv[0][0]), kv[0][1])):
        merged = [fmt.number(r.get("merged_lora_flops")) for r in projs.values()]
        split = [fmt.number(r.get("split_lora_flops")) for r in projs.values()]
        backend = next((b for b in reversed(MOE_BACKENDS) if (model, tokens, b, "split") in experts), None)

        def total(lora):
            r = experts.get((model, tokens, backend, lora))
            f, b = fmt.stat(r, "forward_ms"), fmt.stat(r, "backward_ms")
            return f + b if f is not None and b is not None else None

        out.append({"model": model, "tokens": tokens, "backend": backend,
                    "rank": next((r.get("lora_rank") for r in projs.values() if r.get("lora_rank") is not None), None),
                    "s_star": {p: fmt.number(projs.get(p, {}).get("crossover_tokens")) for p in ("gate_up_proj", "down_proj")},
                    "flops_merged": sum(merged) if None not in merged else None,
                    "flops_split": sum(split) if None not in split else None,
                    "ms_merged": total("merged"), "ms_split": total("split")})
    return out


def moe_crossover_body(rows: list[dict]) -> list[list]:
    """One table row per moe_crossover_points point (CROSSOVER_HEADER's columns)."""
    body = []
    for p in moe_crossover_points(rows):
        fl_m, fl_s, ms_m, ms_s = p["flops_merged"], p["flops_split"], p["ms_merged"], p["ms_split"]
        body.append([p["model"], p["tokens"], p["rank"] if p["rank"] is not None else DASH,
                     fmt.joined(" / ", *(fmt.num(v, ",.0f") for v in p["s_star"].values())),
                     fmt.joined(" → ", fmt.num(fl_m and fl_m / 1e9, ',.1f'), fmt.num(fl_s and fl_s / 1e9, ',.1f')),
                     fmt.joined(" → ", fmt.ms(ms_m), fmt.ms(ms_s), note=p['backend'] or DASH),
                     fmt.times(ms_m / ms_s if ms_m is not None and ms_s else None)])
    return body


def moe_targets_md(rows: list[dict], spec: dict) -> str:
    """The routing targets of ``spec`` (the experiment's ``[report.moe]``) against the layer bench."""
    body = []
    seeds = {k: float(v) for k, v in (spec.get("seeds_routing") or {}).items()}
    by_gpu: dict[str, list[dict]] = {}
    for r in rows_of_kind(rows, "moe_routing"):  # keyed by model and tokens alone: judge each GPU's apart
        by_gpu.setdefault(str(r.get("device_name") or r.get("gpu_slug")), []).append(r)
    for gpu, mine in sorted(by_gpu.items()):
        for pt in moe_routing(mine):
            for metric, target in seeds.items():
                gain = pt[f"sorted_over_loop_{metric}"]
                phase = metric.removesuffix("_ms")
                where = f"{pt['model']} T={pt['tokens']}" + (f", {gpu}" if len(by_gpu) > 1 else "")
                body.append([f"routing {phase}, sorted over loop ≥ {fmt.signed_pct(target)} ({where})",
                             f"{fmt.signed_pct(target)} (GPT-OSS routing path, B200)", gain_cell(gain),
                             fmt.met(None if gain is None else gain >= target)])
    if not body:
        return ""
    return "#### MoE routing\n\n" + fmt.table(["target", "published figure", "measured", "met?"], body)


# ---------------------------------------------------------------------------------------------
# End-to-end targets read from an experiment's sweep rows (not bench files)

def best_p50(rows, model, seq_len, variants) -> tuple[float | None, str | None, list[str]]:
    """Fastest ok p50 (median over repeats) among ``variants``; the statuses of failed ones."""
    best, name, failed = None, None, []
    for v in variants:
        mine = [r for r in rows if r.get("model") == model and r.get("seq_len") == seq_len
                and r.get("variant") == v]
        ok = sorted(p for r in mine if r.get("status") == "ok" and (p := fmt.stat(r, "step_ms")) is not None)
        failed += [f"{v}: {r.get('status')}" for r in mine if r.get("status") != "ok"]
        if ok:
            med = ok[len(ok) // 2]
            if best is None or med < best:
                best, name = med, v
    return best, name, failed


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ms = a + b·tokens through the points; None for fewer than two lengths."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((t - mt) * (y - my) for t, y in points) / sum((t - mt) ** 2 for t, _ in points)
    return my - b * mt, b


def _moe_sides(rows) -> tuple[list[str], list[str]]:
    """The stock and our variants among ``rows``, by role."""
    stock = sorted({r["variant"] for r in rows if role_of(r) == "stock"})
    ours = sorted({r["variant"] for r in rows if is_ours(r)})
    return stock, ours


def moe_pairs(rows: list[dict], model: str, eager: str | None = None) -> dict[int, dict]:
    """Per length: best stock and best ours measured side by side, from the latest run (``_runs``)
    that has an ok row on each side, with that run's ``eager`` variant (stock's per-expert loop) when
    it ran it.
    A length with no such run gives each side's best over all runs, marked ``one_run = False``."""
    mine = [r for r in rows if r.get("kind") == "step" and r.get("model") == model]
    stock, ours = _moe_sides(mine)
    out = {}
    for t in sorted({r["seq_len"] for r in mine}):
        at = [r for r in mine if r["seq_len"] == t]
        paired = [run for run in split_runs(at)
                  if best_p50(run, model, t, stock)[0] is not None and best_p50(run, model, t, ours)[0] is not None]
        pick = paired[-1] if paired else at
        s, sv, sf = best_p50(pick, model, t, stock)
        o, ov, of = best_p50(pick, model, t, ours)
        e, _, ef = best_p50(pick, model, t, [eager] if eager else [])
        eager_here = e is not None or bool(ef)
        if not eager_here:  # another run's eager experts: shown, but no ratio against ours
            e, _, ef = best_p50(at, model, t, [eager] if eager else [])
        out[t] = {"stock": s, "stock_variant": sv, "stock_failed": sf, "ours": o, "ours_variant": ov,
                  "ours_failed": of, "eager": e, "eager_failed": ef, "one_run": bool(paired),
                  "eager_same_run": eager_here and bool(paired),
                  "run": run_label(pick) if paired else "different runs"}
    return out


def moe_gap_md(pairs: dict[int, dict], model: str) -> str:
    """Why the stock/ours ratio moves with length: a line ms = a + b·tokens fitted to each side's
    side-by-side points. With a fixed part a and a per-token part b, stock/ours tends to
    b_stock/b_ours at long lengths, and it rises with length only where that limit is above the
    ratio at short lengths (a_stock/a_ours < b_stock/b_ours)."""
    both = [(t, p["stock"], p["ours"]) for t, p in sorted(pairs.items()) if p["stock"] and p["ours"]]
    fs, fo = _fit_line([(t, s) for t, s, _ in both]), _fit_line([(t, o) for t, _, o in both])
    if not fs or not fo or fo[1] <= 0 or fo[0] <= 0:
        return ""
    (a_s, b_s), (a_o, b_o) = fs, fo
    saved = ", ".join(f"{t}: {fmt.ms(s - o)}" for t, s, o in both)
    grows = a_s / a_o < b_s / b_o
    return (f"**How the gap moves with length ({model}).** Fitted to the side-by-side points above "
            f"({', '.join(str(t) for t, _, _ in both)} tokens), stock takes {a_s:.0f} ms + "
            f"{b_s * 1024:.1f} ms per 1k tokens and ours {a_o:.0f} ms + {b_o * 1024:.1f} ms per 1k tokens. "
            f"The fixed parts differ {a_s / a_o:.1f}×, the per-token parts {b_s / b_o:.2f}×, so stock / ours "
            + ("rises with length toward" if grows else "falls with length toward")
            + f" {b_s / b_o:.2f}×. A rising ratio needs ours to cost less than "
            f"{b_s * 1024 / (a_s / a_o):.1f} ms per 1k tokens (stock's per-token part over the fixed-part "
            f"ratio). The milliseconds saved per step do grow with length: {saved}.")


def _seeds_ms(spec: dict) -> dict[str, tuple[str, dict[int, float], str | None]]:
    """``[report.moe.seeds_ms.<model>]``: the published GPU, their ms per length, the GPU judged on."""
    return {model: (t.get("gpu"), {int(k): v for k, v in (t.get("ms") or {}).items()}, t.get("judged_on"))
            for model, t in (spec.get("seeds_ms") or {}).items()}


def moe_e2e_targets_md(rows: list[dict], spec: dict) -> str:
    """Per GPU: ours (optim.moe, split LoRA) vs stock transformers experts + peft per length, each
    pair from one run (``moe_pairs``), and the targets of ``spec`` (the experiment's
    ``[report.moe]``: the speed-up, sorted over loop, what completes, the published step times)."""
    seeds_ms, eager = _seeds_ms(spec), spec.get("eager_experts")
    steps = [r for r in rows if r.get("kind") == "step"]
    out = []
    for slug in sorted({r.get("gpu_slug") or "unknown" for r in steps}):
        g = [r for r in steps if (r.get("gpu_slug") or "unknown") == slug]
        device = next((r.get("device_name") for r in g if r.get("device_name")), slug)
        body, targets, notes = [], [], []
        for model in sorted({r["model"] for r in g}, key=fmt.natural):
            stock, ours = _moe_sides([r for r in g if r["model"] == model])
            if not stock and not ours:
                continue
            seeds_gpu, seeds, judged_on = seeds_ms.get(model, (None, {}, None))
            pairs = moe_pairs(g, model, eager)
            ratios = []
            for t, p in pairs.items():
                s, o, e = p["stock"], p["ours"], p["eager"]
                ratio = s / o if s and o else None
                if ratio and p["one_run"]:
                    ratios.append((t, ratio))
                ref = seeds.get(t)
                body.append([model, t, p["run"],
                             fmt.Cell(f"{fmt.ms(s)} ({p['stock_variant']})", s) if s
                             else ("; ".join(p["stock_failed"]) or "not run"),
                             fmt.Cell(f"{fmt.ms(o)} ({p['ours_variant']})", o) if o
                             else ("; ".join(p["ours_failed"]) or "not run"),
                             fmt.times(ratio if p["one_run"] else None),
                             fmt.Cell(fmt.ms(e) + ("" if p["eager_same_run"] else " (other run)"), e) if e
                             else ("; ".join(p["eager_failed"]) or DASH),
                             fmt.Cell(f"{e / o:.1f}×", e / o) if e and o and p["eager_same_run"] else DASH,
                             fmt.Cell(f"{ref} ({seeds_gpu})", ref) if ref else DASH,
                             # a verdict only on the card the target is judged on; elsewhere the
                             # table compares with none
                             fmt.met(None if o is None or ref is None or (judged_on and judged_on not in str(device))
                                     else o < ref)])
            if (sp := spec.get("speedup")) and sp.get("model") == model:
                t0, want = int(sp["seq_len"]), float(sp["min_ratio"])
                got = dict(ratios).get(t0)
                targets.append([f"best ours ≥ {want:g}× best stock at {t0} tokens ({model})",
                                fmt.times(got) if got else "not run", fmt.met(None if got is None else got >= want)])
                grows = [r for _, r in ratios]
                targets.append([f"the gap grows with sequence length ({model})",
                                fmt.Cell(", ".join(f"{t}: {r:.2f}×" for t, r in ratios), dict(ratios)) if ratios
                                else "not run",
                                fmt.met(None if len(grows) < 2 else all(b >= a for a, b in zip(grows, grows[1:])))])
            if (fits := spec.get("completes")) and fits.get("model") == model:
                t16 = int(fits["seq_len"])
                o16, ov16, of16 = best_p50(g, model, t16, ours)
                s16, _, sf16 = best_p50(g, model, t16, stock)

                def loss_of(variants, ok):
                    modes = {r.get("loss_mode") or "full" for r in g if r["model"] == model
                             and r["seq_len"] == t16 and r["variant"] in variants
                             and (r.get("status") == "ok") == ok}
                    return "/".join(sorted(modes)) or "?"

                caveat = ""
                if o16 is not None and sf16 and loss_of([ov16], True) != loss_of(stock, False):
                    # the loss, not the experts, may decide what fits: say so beside the verdict
                    caveat = (f" (ours with the {loss_of([ov16], True)} loss, stock's failure with the "
                              f"{loss_of(stock, False)} loss)")
                if o16 is not None and s16 is not None:
                    # both fit (a larger GPU): the target's premise does not hold here, so no verdict
                    caveat += "; stock fits on this GPU, so the target has nothing to judge here"
                    verdict = None
                else:
                    verdict = None if o16 is None and not of16 else (o16 is not None and s16 is None and bool(sf16))
                targets.append([f"ours completes {t16} tokens where stock runs out of memory ({model})",
                                fmt.Cell(f"ours {fmt.ms(o16) if o16 else ('; '.join(of16) or 'not run')}, "
                                         f"stock {fmt.ms(s16) if s16 else ('; '.join(sf16) or 'not run')}{caveat}",
                                         {"ours": o16 or "; ".join(of16) or None,
                                          "stock": s16 or "; ".join(sf16) or None}),
                                fmt.met(verdict)])
            sol = spec.get("sorted_over_loop")
            if sol and sol.get("model") == model and spec.get("loop") and spec.get("sorted"):
                t0, want = int(sol["seq_len"]), float(sol["min_gain_pct"])
                lp, _, _ = best_p50(g, model, t0, [spec["loop"]])
                sp, _, _ = best_p50(g, model, t0, [spec["sorted"]])
                gain = fmt.gain_pct(lp, sp)
                targets.append([f"sorted over loop end to end ≥ +{want:.0f}% ({model}, {t0}, "
                                f"{spec['loop']} → {spec['sorted']})",
                                fmt.Cell(f"{gain_cell(gain)} ({fmt.ms(lp)} → {fmt.ms(sp)} ms)", (gain, lp, sp))
                                if gain is not None else "not run",
                                fmt.met(None if gain is None else gain >= want)])
            if (gap := moe_gap_md({t: p for t, p in pairs.items() if p["one_run"]}, model)):
                notes.append(gap)
            if seeds and judged_on and judged_on in str(device):
                # each length on the row the table above shows for it (its paired run), not the
                # fastest of every run
                beats = [(t, o < seeds[t]) for t in seeds
                         if (o := (pairs.get(t) or {}).get("ours")) is not None]
                targets.append([f"ours below the published {seeds_gpu} figures at every length ({model})",
                                fmt.Cell(", ".join(f"{t}: {'yes' if b else 'no'}" for t, b in beats), dict(beats))
                                if beats else "not run",
                                fmt.met(None if len(beats) < len(seeds) and all(b for _, b in beats)
                                     else all(b for _, b in beats) and len(beats) == len(seeds))])
        if body:
            out.append(f"### {device} (`{slug}`): ours vs stock, end to end\n\n" + fmt.table(
                ["model", "tokens", "run", "best stock ms p50", "best ours ms p50", "stock / ours",
                 "stock eager experts ms p50", "eager / ours", "published ms", "ours below published?"], body)
                + "\n\nEach length's pair comes from one run: the latest run (rows recorded within "
                  f"{SAME_RUN_MINUTES} minutes of each other, same code) with an ok row on both sides; `run` "
                  "gives its start (UTC). Stock eager experts are transformers' per-expert loop, the other peer "
                  "baseline, from the same run where it ran there. `different runs` marks a length no single "
                  "run covered: each side's best over all runs, and no ratio.")
        out += notes
        if targets:
            out.append(f"#### End-to-end targets on {device}\n\n" + fmt.table(["target", "measured", "met?"], targets)
                       + "\n\nA target whose points were not all run shows `–` (not judged) rather than no.")
    return "\n\n".join(out)


_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = 2**30


def gpu_memory_gib(rows: list[dict]) -> dict[str, float]:
    """device name -> its memory in GiB, as the step rows' env records it."""
    return {str(r.get("device_name")): fmt.number((r.get("env") or {}).get("memory_total_gib"))
            for r in rows if r.get("kind") == "step" and (r.get("env") or {}).get("memory_total_gib")}


def moe_fit(rows: list[dict], model: str) -> dict | None:
    """What would make ``model`` fit on the smallest GPU the rows ran on: its measured peaks split
    into the fixed part (frozen weights; adapters, their grads and AdamW's two states) and the
    per-token slope of our split-LoRA rows, then the fixed part under each change, as arithmetic
    on those measurements. None where the rows cannot say (one length, no GPU capacity)."""
    ours = [r for r in rows if r.get("kind") == "step" and r.get("status") == "ok" and r.get("model") == model
            and is_ours(r) and (r.get("loss_mode") or "full") == "full" and fmt.number(r.get("peak_allocated_gib")) is not None]
    caps = gpu_memory_gib(rows)
    # one adapter dtype for the line: peft's default where measured (bf16-adapter rows would lower it)
    dtypes = {r.get("lora_dtype") or "fp32" for r in ours}
    keep = "fp32" if "fp32" in dtypes else min(dtypes, default="fp32")
    ours = [r for r in ours if (r.get("lora_dtype") or "fp32") == keep]
    if len({r["seq_len"] for r in ours}) < 2 or not caps:
        return None
    small_gpu, cap = min(caps.items(), key=lambda kv: kv[1])
    r0 = ours[0]
    total, trainable = fmt.number(r0.get("total_params")), fmt.number(r0.get("trainable_params"))
    if not total or not trainable:
        return None
    w_b = _BYTES.get(str(r0.get("dtype")), 2)
    a_b = 4 if (r0.get("lora_dtype") or "fp32") == "fp32" else w_b
    frozen = (total - trainable) * w_b / GIB
    state = trainable * a_b * 4 / GIB  # weights, grads, AdamW exp_avg and exp_avg_sq
    by_t: dict[int, float] = {}
    for r in ours:  # the lowest peak per length among our variants
        t, pk = int(r["seq_len"]), fmt.number(r["peak_allocated_gib"])
        by_t[t] = min(by_t.get(t, pk), pk)
    ts = sorted(by_t)
    slope = (by_t[ts[-1]] - by_t[ts[0]]) / (ts[-1] - ts[0])  # GiB per token
    line0 = by_t[ts[0]] - slope * ts[0]  # the peak at zero tokens, by the same line
    base = max(line0, frozen + state)  # never below what the weights and the state take
    rank = int(r0.get("lora_rank") or 16)

    scen = [("as measured (adapters fp32, peft's default)" if a_b == 4 else "as measured", 0.0)]
    if a_b == 4:
        scen.append(("adapters in bf16 (`lora_dtype = \"model\"`)", state / 2))
        if rank > 16:
            scen.append((f"adapters in bf16, rank 16 instead of {rank}", state - state / 2 * 16 / rank))
    scen.append(("AdamW's two states on the host", state / 2))
    scen.append(("frozen weights in 8 bits", frozen / 2))
    # rows that ran with bf16 adapters test the bf16 row of the table: measured peak vs projected
    bf16_zero = base - state / 2 if a_b == 4 else None
    tried: dict[tuple[str, int], float | None] = {}
    for r in rows:
        if (r.get("kind") == "step" and r.get("model") == model and r.get("lora_dtype") == "model"
                and is_ours(r) and (r.get("loss_mode") or "full") == "full"):
            key = (str(r.get("device_name")), int(r["seq_len"]))
            pk = fmt.number(r.get("peak_allocated_gib")) if r.get("status") == "ok" else None
            if key not in tried or (pk is not None and (tried[key] is None or pk < tried[key])):
                tried[key] = pk
    return {
        "model": model, "small_gpu": small_gpu, "cap_gib": cap, "peaks_gib": by_t, "slope_gib_per_token": slope,
        "zero_tokens_gib": line0, "frozen_gib": frozen, "state_gib": state, "base_gib": base,
        "frozen_params": total - trainable, "trainable_params": trainable, "weight_bytes": w_b, "adapter_bytes": a_b,
        # (change, saves GiB, peak at zero tokens GiB, left on the GPU GiB, tokens that fit at the slope)
        "changes": [(name, saved, base - saved, cap - (base - saved),
                     int((cap - (base - saved)) / slope) if cap - (base - saved) > 0 else 0) for name, saved in scen],
        # (device, tokens, measured peak or None, projected peak) of the rows run with bf16 adapters
        "bf16_checks": [(dev, t, pk, bf16_zero + slope * t) for (dev, t), pk in sorted(tried.items())]
        if bf16_zero is not None else [],
    }


def moe_fit_md(rows: list[dict], model: str) -> str:
    """``moe_fit`` as a section: the measured line, then a table of each change's projection."""
    f = moe_fit(rows, model)
    if f is None:
        return ""
    small_gpu, slope = f["small_gpu"], f["slope_gib_per_token"]
    body = [[name, fmt.num(saved, ".1f"), fmt.num(zero, ".1f"),
             fmt.Cell(f"{left:.1f}" + (f" (≈ {tokens:,} tokens)" if left > 0 else " (none)"), (left, tokens))]
            for name, saved, zero, left, tokens in f["changes"]]
    peaks = ", ".join(f"{t}: {g:.1f}" for t, g in sorted(f["peaks_gib"].items()))
    checks = [f"{t} tokens on the {dev}: " + (f"{pk:.1f} GiB (projected {proj:.1f})" if pk is not None
                                               else "did not run to the end")
              for dev, t, pk, proj in f["bf16_checks"]]
    measured_bf16 = ("\n\nMeasured with bf16 adapters (`lora_dtype = \"model\"`), allocated peak per run: "
                     + "; ".join(checks) + ".") if checks else ""
    frozen, state = f["frozen_gib"], f["state_gib"]
    return (f"### What would fit {model} on one {small_gpu}\n\n"
            f"Our split-LoRA rows peaked at {peaks} GiB allocated (tokens: GiB): "
            f"{slope * 1024:.2f} MiB per token on a line through {f['zero_tokens_gib']:.1f} GiB at zero tokens. Weights and "
            f"trainable state alone take {frozen + state:.1f} GiB: {frozen:.1f} GiB for the "
            f"{f['frozen_params'] / 1e9:.2f} B frozen weights ({f['weight_bytes']} bytes each) and {state:.1f} GiB for the "
            f"{f['trainable_params'] / 1e9:.2f} B adapter parameters with their grads and AdamW's two states "
            f"({f['adapter_bytes']} bytes each); the table starts from the larger of the two. The {small_gpu} has "
            f"{f['cap_gib']:.1f} GiB.\n\n" + fmt.table(
                ["change", "saves GiB", "peak at zero tokens GiB", f"left on the {small_gpu} GiB (tokens at the measured slope)"], body)
            + "\n\nOnly the first row is measured; each other row is that line lowered by what the change "
              "saves (a projection, not a run). The CUDA context and the allocator's reserve come on top "
              "of the allocated peak. `lora_dtype = \"model\"` exists in the harness "
              "(`grouped_mm-split-bf16lora` in `experiments/moe.toml`); the host-side optimizer and 8-bit "
              "weights need code this project does not have (no bitsandbytes here)." + measured_bf16)


def bench_tables(rows: list[dict], spec: dict) -> str:
    return moe_tables(rows)


def bench_targets(rows: list[dict], spec: dict) -> str:
    return moe_targets_md(rows, spec)


def sweep_targets(steps: list[dict], rows: list[dict], spec: dict) -> str:
    fit = spec.get("fit_model")
    return "\n\n".join(t for t in (moe_e2e_targets_md(steps, spec), moe_fit_md(steps, fit) if fit else "") if t)
