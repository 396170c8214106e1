"""Offloaded checkpointing: the side-by-side modes, their derived figures and targets."""

from __future__ import annotations

import re

from harness.report.fmt import DASH, GIB, MIB
from harness.report import fmt
from harness.variant_keys import SWITCHES

OFFLOAD_MODES = SWITCHES["offload"].choices
# The caching allocator rounds large blocks up to 2 MiB, so a measured peak delta may exceed the
# buffer it holds by that much without a second buffer being any larger.
ALLOCATOR_SLACK_GIB = 2 * MIB / GIB
RATIO_OK = (0.5, 1.5)
NONE_STEP_TOLERANCE_PCT = 5.0

# ---------------------------------------------------------------------------------------------
# Offloaded checkpointing (bench_offload)


def _seed_key(model: str, seeds: dict) -> str | None:
    """The key of ``seeds`` (sizes such as "8b") that names ``model``'s size, if any."""
    sizes = "|".join(re.escape(k.lower().removesuffix("b")) for k in seeds)
    hit = re.search(rf"(?<![\d.])({sizes})b(?![a-z0-9])", model.lower()) if sizes else None
    return f"{hit[1]}b" if hit else None


def offload_points(rows: list[dict]) -> list[dict]:
    """One dict per (model, seq_len, batch, GPU) with its mode rows, its summary and derived
    numbers; where the rows hold more than one GPU, each point's label names its GPU."""
    points: dict[tuple, dict] = {}
    for r in rows:
        if r["kind"] not in ("offload", "offload_summary"):
            continue
        key = (str(r.get("model") or "unknown"), int(fmt.number(r.get("seq_len")) or 0), int(fmt.number(r.get("batch_size")) or 0),
               str(r.get("gpu_slug") or ""))
        pt = points.setdefault(key, {"model": key[0], "seq_len": key[1], "batch": key[2], "gpu": key[3],
                                     "device_name": r.get("device_name"), "modes": {},
                                     "summary": {}, "failed": [], "layer_bytes": None, "num_layers": None})
        pt["layer_bytes"] = fmt.first(r.get("layer_input_bytes"), pt["layer_bytes"])
        pt["num_layers"] = fmt.first(r.get("num_layers"), pt["num_layers"])
        if r["kind"] == "offload_summary":
            pt["summary"] = r  # a re-measured point: the later row (file order) is the answer
        elif r.get("mode") in (*OFFLOAD_MODES, "single_profile", "double_profile"):
            pt["modes"][r["mode"]] = r
        if r.get("status") not in (None, "ok"):
            pt["failed"].append(r)
    several = len({k[3] for k in points}) > 1
    for pt in points.values():
        pt.update(_offload_derived(pt))
        pt["named_gpu"] = several
    return [points[k] for k in sorted(points, key=lambda k: (fmt.natural(k[0]), k[1:]))]


def _offload_derived(pt: dict) -> dict:
    s_row, m = pt["summary"], pt["modes"]
    ok = {k: r for k, r in m.items() if r.get("status") == "ok"}
    p50 = {k: fmt.stat(ok.get(k), "step_ms") for k in OFFLOAD_MODES}
    peak = {k: fmt.number((ok.get(k) or {}).get("peak_allocated_gib")) for k in OFFLOAD_MODES}
    c, g = fmt.number(s_row.get("c_ms")), fmt.number(s_row.get("g_ms"))
    n = fmt.number(s_row.get("layers_reloaded"))
    hidden = min(c, g) if c is not None and g is not None else None
    predicted = (n - 1) * hidden if hidden is not None and n else fmt.number(s_row.get("predicted_saving_ms"))
    single, double = p50["single"], p50["double"]
    measured = fmt.first(fmt.diff(single, double), s_row.get("measured_saving_ms"))
    layer_gib = pt["layer_bytes"] / GIB if pt["layer_bytes"] else None
    return {
        "p50": p50, "peak": peak, "c": c, "g": g, "n": n, "predicted": predicted, "measured": measured,
        "ratio": measured / predicted if measured is not None and predicted else None,
        "double_over_single_pct": fmt.first(fmt.gain_pct(single, double), s_row.get("double_over_single_pct")),
        "model_pct": fmt.number(s_row.get("predicted_double_over_single_pct")),
        "per_layer_bound_pct": 100 * hidden / (c + g) if hidden is not None and c + g else None,
        # the steps/s gain if all of (n−1)·min(c, g) were hidden: ≈ (n−1)·min(c,g) / T_single
        "bound_pct": 100 * predicted / (single - predicted)
        if predicted is not None and single and single > predicted else None,
        "double_vs_none_pct": fmt.first(fmt.gain_pct(double, p50["none"]), s_row.get("double_vs_none_step_pct")),
        "double_over_soc_pct": fmt.first(fmt.gain_pct(p50["save_on_cpu"], double), s_row.get("double_over_save_on_cpu_pct")),
        "buffer_gib": fmt.number(s_row.get("second_buffer_gib")),
        "buffer_peak_gib": fmt.first(s_row.get("second_buffer_peak_gib"), fmt.diff(peak["double"], peak["single"])),
        "layer_gib": layer_gib,
        "saved_vs_none_gib": fmt.first(fmt.diff(peak["none"], peak["double"]), s_row.get("vram_saved_vs_none_gib")),
        "trace": s_row.get("trace") if isinstance(s_row.get("trace"), dict) else {},
    }


def _point(pt: dict) -> str:
    where = f", {pt.get('device_name') or pt.get('gpu')}" if pt.get("named_gpu") else ""
    return f"{pt['model']} T={pt['seq_len']} B={pt['batch']}{where}"


def ratio_cell(ratio) -> str:
    if fmt.number(ratio) is None:
        return fmt.Cell(DASH, None)
    return fmt.Cell(f"{ratio:.2f}" + ("" if RATIO_OK[0] <= ratio <= RATIO_OK[1] else " ⚠"), ratio)


def offload_tables(points: list[dict], rows: list[dict]) -> str:
    ident = ["model", "seq_len", "batch", "MiB / layer input"]

    def ids(pt):
        return [pt["model"], pt["seq_len"], pt["batch"], fmt.num(pt["layer_bytes"] and pt["layer_bytes"] / MIB, ".0f")]

    steps = []
    for pt in points:
        peaks = " / ".join(fmt.num(pt["peak"][k], ".2f") for k in OFFLOAD_MODES)
        steps.append([*ids(pt), *(fmt.spread(pt["modes"].get(k), "step_ms") for k in OFFLOAD_MODES), peaks])
    header = [*ident, *(f"{k} step ms p50 [p20–p80]" for k in OFFLOAD_MODES),
              "peak alloc GiB " + " / ".join(OFFLOAD_MODES)]
    model = []
    for pt in points:
        tr = pt["trace"]
        c_pred = (f"{fmt.ms(pt['summary'].get('c_pred_ms'))} @ {fmt.num(pt['summary'].get('pinned_gbps'), '.1f')} GB/s"
                  if fmt.number(pt["summary"].get("c_pred_ms")) is not None else DASH)
        buffer = (f"{fmt.num(pt['buffer_gib'], '.3f')} (peak {fmt.num(pt['buffer_peak_gib'], '+.3f')}) / "
                  f"{fmt.num(pt['layer_gib'], '.3f')}")
        copies = f"{tr['h2d_pinned']}/{tr['h2d_count']}" if "h2d_pinned" in tr and "h2d_count" in tr else DASH
        model.append([
            *ids(pt), f"{fmt.ms(pt['c'])} ({c_pred})", fmt.ms(pt["g"]), fmt.num(pt["n"], ".0f"),
            fmt.ms(pt["predicted"]), fmt.ms(pt["measured"]), ratio_cell(pt["ratio"]),
            f"{fmt.signed_pct(pt['double_over_single_pct'])} (model {fmt.signed_pct(pt['model_pct'])}, "
            f"per layer ≤ {fmt.num(pt['per_layer_bound_pct'], '.1f')}%)",
            fmt.signed_pct(pt["double_vs_none_pct"]), fmt.signed_pct(pt["double_over_soc_pct"]), buffer,
            fmt.num(pt["saved_vs_none_gib"], ".2f"),
            f"{fmt.num(fmt.number(tr.get('overlap_pct')), '.1f')}%" if fmt.number(tr.get("overlap_pct")) is not None else DASH, copies,
        ])
    model_header = [*ident, "c ms (bytes / pinned BW)", "g ms", "n reloaded", "predicted saving ms (n−1)·min(c,g)",
                    "measured saving ms single − double", "measured / predicted",
                    "double over single (model; per-layer bound)", "double step vs none", "double over save_on_cpu",
                    "2nd buffer GiB (peak Δ) / one layer input GiB", "VRAM saved vs none GiB",
                    "H2D overlap", "pinned / total H2D"]
    timed = [r for r in rows if r["kind"] == "offload"]
    warm, measured = fmt.distinct(r.get("warmup_steps") for r in timed), fmt.distinct(r.get("measured_steps") for r in timed)
    parts = [
        "#### Offloaded checkpointing: step time and peak memory per mode\n\n" + fmt.table(header, steps),
        "All four modes of a point run in one process on one model, each for full steps (forward, "
        f"backward, AdamW): warm-up steps {warm}, measured steps {measured}; CUDA-event step time p50 "
        "with p20–p80." + fmt.loss_note(timed),
        "#### Offloaded checkpointing: overlap model\n\n" + fmt.table(model_header, model),
        "c = one layer input's reload alone (event-timed in `single`), beside bytes / measured pinned "
        "bandwidth; g = one layer's recompute + backward; double can hide at most min(c, g) per layer, "
        "so it saves (n−1)·min(c, g) over single (⚠: measured / predicted outside "
        f"{RATIO_OK[0]}–{RATIO_OK[1]}). \"Over\" columns are steps/s gains (+ = double faster); "
        "\"double step vs none\" is the step-time cost (+ = double slower). The per-layer bound is "
        "100·min(c, g)/(c + g), the share of one layer's single-buffered time double can hide. "
        "Overlap is the share of H2D copy time with a kernel of another stream running, from a "
        "torch.profiler trace of one double step.",
    ]
    failed = [r for pt in points for r in pt["failed"]]
    if failed:
        parts.append("Not measured: " + "; ".join(
            f"{r.get('model')} T={r.get('seq_len')} B={r.get('batch_size')} {r.get('mode')}: "
            f"{r.get('status')} ({' '.join(str(r.get('message') or '').split())[:120]})" for r in failed) + ".")
    return "\n\n".join(parts)


def offload_targets(points: list[dict], seeds: dict) -> list[dict]:
    """Target rows: {target, seeds, measured, ok (bool | None), note}; ``seeds`` is
    ``[report.offload.seeds]`` (the published headline per model size)."""
    out = []
    for pt in points:
        key = _seed_key(pt["model"], seeds)
        if key is None:
            continue
        seed = seeds[key]
        gain, bound = pt["double_over_single_pct"], pt["bound_pct"]
        ok = None if gain is None else gain >= seed["gain_pct"]
        note = ""
        if bound is not None and bound < seed["gain_pct"]:
            note = f"unreachable: bound {fmt.signed_pct(bound)} < {fmt.signed_pct(seed['gain_pct'])}"
        out.append({"target": f"double over single ≥ {fmt.signed_pct(seed['gain_pct'])} ({_point(pt)})",
                    "seeds": f"{fmt.signed_pct(seed['gain_pct'])} ({seed['steps_per_s']} steps/s, {key.upper()}, B200)",
                    "measured": fmt.Cell(f"{fmt.signed_pct(gain)} (bound {fmt.signed_pct(bound)})", (gain, bound)),
                    "ok": ok, "note": note})
    for pt in points:
        key = _seed_key(pt["model"], seeds)
        buf, delta, layer = pt["buffer_gib"], pt["buffer_peak_gib"], pt["layer_gib"]
        ok = None
        if layer is not None and (buf is not None or delta is not None):
            ok = ((buf is None or buf <= layer) and (delta is None or delta <= layer + ALLOCATOR_SLACK_GIB))
        out.append({"target": f"second buffer ≤ one layer input ({_point(pt)})",
                    "seeds": f"+{seeds[key]['extra_vram_gb']:.2f} GB extra VRAM ({key.upper()})" if key else DASH,
                    "measured": DASH if buf is None and delta is None else
                    fmt.Cell(f"{fmt.num(buf, '.3f')} GiB, peak {fmt.num(delta, '+.3f')} GiB vs {fmt.num(layer, '.3f')} GiB",
                             (buf, delta, layer)),
                    "ok": ok, "note": ""})
    for pt in points:
        cost, saved = pt["double_vs_none_pct"], pt["saved_vs_none_gib"]
        ok = None if cost is None or saved is None else cost <= NONE_STEP_TOLERANCE_PCT and saved > 0
        out.append({"target": f"double within {NONE_STEP_TOLERANCE_PCT:.0f}% of none, peak below none ({_point(pt)})",
                    "seeds": DASH,
                    "measured": DASH if cost is None and saved is None else
                    fmt.Cell(f"step {fmt.signed_pct(cost)}, peak {fmt.num(pt['peak']['double'], '.2f')} vs "
                             f"{fmt.num(pt['peak']['none'], '.2f')} GiB", (cost, pt["peak"]["double"], pt["peak"]["none"])),
                    "ok": ok, "note": ""})
    gains = [pt["double_over_soc_pct"] for pt in points]
    known = [x for x in gains if x is not None]
    if points:
        ok = None if not known else all(x > 0 for x in known)
        measured = (fmt.Cell(f"{fmt.signed_pct(min(known))} … {fmt.signed_pct(max(known))} over {len(known)} points",
                             (min(known), max(known), len(known))) if known else DASH)
        out.append({"target": "double faster than save_on_cpu at every point", "seeds": DASH,
                    "measured": measured, "ok": ok,
                    "note": f"{len(gains) - len(known)} point(s) unmeasured" if ok and len(known) < len(gains) else ""})
    return out


def offload_bound_paragraph(points: list[dict], seeds: dict) -> str:
    known = [pt for pt in points if pt["bound_pct"] is not None]
    if not known:
        return ""

    def term(pt):
        c, g, n, single = pt["c"], pt["g"], pt["n"], pt["p50"]["single"]
        if None in (c, g, n, single):
            return f"{_point(pt)}: {fmt.signed_pct(pt['bound_pct'])}"
        return f"{_point(pt)}: ({n:.0f}−1)·{fmt.ms(min(c, g))} ms / {fmt.ms(single)} ms → {fmt.signed_pct(pt['bound_pct'])}"

    sides = {"c" if pt["c"] <= pt["g"] else "g" for pt in known if pt["c"] is not None and pt["g"] is not None}
    side = {"c": " At every point here c < g: the copy is the short side, so only the reload time can be hidden, "
                 "however long the recompute.",
            "g": " At every point here g < c: the recompute is the short side."}.get("".join(sides), "")
    short = []
    for pt in known:
        key = _seed_key(pt["model"], seeds)
        if key and pt["bound_pct"] < seeds[key]["gain_pct"]:
            short.append(f"{_point(pt)} (bound {fmt.signed_pct(pt['bound_pct'])} < {fmt.signed_pct(seeds[key]['gain_pct'])})")
    targeted = [pt for pt in known if _seed_key(pt["model"], seeds)]
    if short:
        verdict = f" The published target is not reachable where the bound is below it: {'; '.join(short)}."
    elif targeted:
        verdict = " The bound is above the published target at every point, so the target is reachable in principle."
    else:
        verdict = ""
    return ("Double buffering can at best hide min(c, g) per reloaded layer (the next layer's copy runs "
            "behind this layer's recompute and backward), so its gain over single is bounded by ≈ "
            "(n−1)·min(c, g)/T_single (here as a steps/s gain, T_single/(T_single − (n−1)·min(c, g)) − 1): "
            + "; ".join(term(pt) for pt in known) + "." + side + verdict)


def offload_targets_md(points: list[dict], spec: dict) -> str:
    """The offload targets; ``spec`` is the experiment's ``[report.offload]``."""
    seeds = spec.get("seeds") or {}
    rows = offload_targets(points, seeds)
    if not rows:
        return ""
    body = [[r["target"], r["seeds"], r["measured"], fmt.met(r["ok"], r["note"])] for r in rows]
    parts = ["#### Offloaded checkpointing\n\n" + fmt.table(["target", "published figure", "measured", "met?"], body),
             f"The buffer target lets the measured peak delta exceed one layer input by "
             f"{ALLOCATOR_SLACK_GIB * GIB / MIB:.0f} MiB, the caching allocator's block rounding."]
    if para := offload_bound_paragraph(points, seeds):
        parts.append(para)
    return "\n\n".join(parts)




# The report's parts (harness.measured)
def bench_tables(rows: list[dict], spec: dict) -> str:
    points = offload_points(rows)
    return offload_tables(points, rows) if points else ""


def bench_targets(rows: list[dict], spec: dict) -> str:
    return offload_targets_md(offload_points(rows), spec)
