"""Packed sequences: metadata build cost m, structure builds per step, the cache's saving against
(L−1)·m, and packed against stock."""

from __future__ import annotations

from harness.report.fmt import DASH, GIB
from harness.report import fmt
from harness.report.moe import gain_cell, rows_of_kind, best_p50
from harness.report.offload import ratio_cell
from harness.report.runs import steps_by_gpu, median_of, from_one_run, run_note, run_verdict
from harness.roles import is_ours

# ---------------------------------------------------------------------------------------------
# Packed-sequence metadata (bench_packing)


def packing_m(rows: list[dict]) -> list[dict]:
    """Per (backend incl. window/sinks, seq_len): the m rows from lengths and from position_ids."""
    points: dict[tuple, dict] = {}
    for r in rows_of_kind(rows, "packing_m"):
        label = str(r.get("backend") or "unknown")
        if r.get("window") is not None:
            label += f" (window {r['window']})"
        if r.get("sinks"):
            label += " (sinks)"
        key = (label, int(fmt.number(r.get("seq_len")) or 0))
        src = "position_ids" if r.get("from_position_ids") else "lengths"
        points.setdefault(key, {"backend": key[0], "seq_len": key[1]})[src] = r
    return [points[k] for k in sorted(points)]


def packing_tables(rows: list[dict], spec: dict) -> str:
    """The packing bench's m and structure-count tables; ``spec`` is ``[report.packing]``."""
    parts = []
    ms = packing_m(rows)
    if ms:
        def m(r):
            if r is None or fmt.number(r.get("m_ms")) is None:
                return DASH
            if fmt.number(r.get("m_p20_ms")) is None:
                return fmt.ms(r["m_ms"])
            return f"{fmt.ms(r['m_ms'])} [{fmt.ms(r['m_p20_ms'])}–{fmt.ms(r['m_p80_ms'])}]"

        body = [[pt["backend"], pt["seq_len"], m(pt.get("lengths")), m(pt.get("position_ids")),
                 fmt.ms(fmt.diff((pt.get("position_ids") or {}).get("m_ms"), (pt.get("lengths") or {}).get("m_ms")))]
                for pt in ms]
        source = ("the printed m lines (p50 only)" if all(r.get("source") == "log" for r in rows_of_kind(rows, "packing_m"))
                  else "packing_m rows, p50 [p20–p80]")
        parts.append("#### Packed metadata build cost m\n\n" + fmt.table(
            ["backend", "packed tokens", "m ms from lengths", "m ms from position_ids", "position_ids extra ms"], body)
            + f"\n\nm = one metadata + attention-structure build for a fresh packed batch, CUDA events and host "
              f"time (the larger); from {source}." + (f" Seeds: {spec['seeds_m']}." if spec.get("seeds_m") else ""))
    counts = [r for r in rows_of_kind(rows, "packing_counts") if isinstance(r.get("cache_on"), dict)]
    if counts:
        def syncs(r):
            on, off = r.get("cache_on") or {}, r.get("cache_off") or {}
            return f"{fmt.or_dash(on.get('packing_host_syncs'))} / {fmt.or_dash(off.get('packing_host_syncs'))}"

        body = [[r.get("model"), r.get("seq_len"), r.get("backend"), "yes" if r.get("with_metadata") else "no",
                 r.get("num_layers"), f"{fmt.or_dash(r.get('builds_on'))} / {fmt.or_dash(r.get('builds_off'))}", syncs(r),
                 fmt.ms(r.get("m_ms")), fmt.ms(r.get("predicted_saving_ms")), fmt.ms(r.get("seeds_prediction_ms"))]
                for r in sorted(counts, key=lambda r: (fmt.natural(r.get("model")), fmt.number(r.get("seq_len")) or 0,
                                                       str(r.get("backend")), not r.get("with_metadata")))]
        parts.append("#### Structure builds and host syncs per training step\n\n" + fmt.table(
            ["model", "seq_len", "backend", "metadata passed", "L", "builds cache on / off",
             "packing host syncs on / off", "m ms", "predicted saving ms (off − on)·m", "published (L−1)·m ms"], body))
    return "\n\n".join(parts)


# Per packing backend, the counter of its attention-structure builds (optim.packing.COUNTERS).
STRUCTURE_COUNTER = {"sdpa": "sdpa_mask", "flex": "flex_block_mask", "varlen": "varlen_args"}


def _compiled(r: dict) -> bool:
    return bool((r.get("switches") or {}).get("compile_layers", False))


def packing_cache_points(rows: list[dict], m_rows: list[dict]) -> list[dict]:
    """Per (gpu, model, seq_len, backend, compile_layers) with both cache on and off measured: builds
    per step (counted), m (bench rows of the same ``gpu_slug``, from lengths), the predicted
    (builds_off − builds_on)·m, the published (L−1)·m, the measured off − on step time and their ratio.
    Rows with compiled layers are only ever paired with compiled rows (a missing key means not compiled)."""
    steps = [r for r in rows if r.get("kind") == "step" and r.get("status") == "ok"]
    plain_m = [r for r in m_rows if r.get("kind") == "packing_m" and not r.get("from_position_ids")
               and r.get("window") is None and not r.get("sinks")]
    m_by = {(r.get("gpu_slug"), str(r.get("backend")), int(fmt.number(r.get("seq_len")) or 0)): fmt.number(r.get("m_ms"))
            for r in plain_m}
    m_dev_by = {(r.get("gpu_slug"), str(r.get("backend")), int(fmt.number(r.get("seq_len")) or 0)): fmt.number(r.get("m_device_ms"))
                for r in plain_m}
    groups: dict[tuple, dict] = {}
    for r in steps:
        sw = r.get("switches") or {}
        backend = sw.get("packing_backend")
        if backend not in STRUCTURE_COUNTER or "packing_cache" not in sw:
            continue
        key = (r.get("gpu_slug") or "unknown", r.get("model"), r.get("seq_len"), backend, _compiled(r))
        groups.setdefault(key, {}).setdefault(bool(sw["packing_cache"]), []).append(r)
    out = []
    for (slug, model, t, backend, compiled), by in sorted(
            groups.items(), key=lambda kv: (kv[0][0], fmt.natural(kv[0][1]), fmt.number(kv[0][2]) or 0, kv[0][3], kv[0][4])):
        if True not in by or False not in by:
            continue
        # each side's newest row: a rerun of the pair replaces the older one, whatever the file order
        on, off = (max(by[side], key=lambda r: str(r.get("recorded_at") or "")) for side in (True, False))
        counter = STRUCTURE_COUNTER[backend]

        def per_step(r, counter=counter):
            n = fmt.number((r.get("packing_counters") or {}).get(counter))
            steps_n = fmt.number(r.get("measured_steps"))
            return n / steps_n if n is not None and steps_n else None

        b_on, b_off = per_step(on), per_step(off)
        m = m_by.get((slug, backend, int(fmt.number(t) or 0)))
        m_dev = m_dev_by.get((slug, backend, int(fmt.number(t) or 0)))
        pred = (b_off - b_on) * m if None not in (b_on, b_off, m) else None
        pred_dev = (b_off - b_on) * m_dev if None not in (b_on, b_off, m_dev) else None
        layers = fmt.number(on.get("num_layers"))
        p_on, p_off = fmt.stat(on, "step_ms"), fmt.stat(off, "step_ms")
        meas = fmt.diff(p_off, p_on)
        out.append({"gpu": slug, "model": model, "seq_len": t, "backend": backend, "compiled": compiled,
                    "builds_on": b_on, "builds_off": b_off, "m_ms": m, "predicted_ms": pred,
                    "predicted_device_ms": pred_dev,
                    "seeds_ms": (layers - 1) * m if layers and m is not None else None,
                    "on_ms": p_on, "off_ms": p_off, "measured_ms": meas,
                    "ratio": meas / pred if meas is not None and pred else None,
                    "ratio_device": meas / pred_dev if meas is not None and pred_dev else None,
                    "gain_pct": fmt.gain_pct(p_off, p_on), "noise_pct": _noise_pct(on, off),
                    "noise_ms": _width_ms(on, off), "one_run": from_one_run([on, off])})
    return out


def _noise_pct(*rows) -> float | None:
    """The larger within-run step-time spread (p80/p20 − 1, in %) of the rows compared."""
    spreads = []
    for r in rows:
        p20, p80 = fmt.stat(r, "step_ms", "p20"), fmt.stat(r, "step_ms", "p80")
        if p20 and p80:
            spreads.append(p80 / p20)
    return (max(spreads) - 1) * 100 if spreads else None


def _width_ms(*rows) -> float | None:
    """The wider p20–p80 step-time band (ms) of the rows compared."""
    widths = [p80 - p20 for r in rows if (p20 := fmt.stat(r, "step_ms", "p20")) is not None
              and (p80 := fmt.stat(r, "step_ms", "p80")) is not None]
    return max(widths) if widths else None


def _backend_label(p: dict) -> str:
    return p["backend"] + (" (compiled)" if p.get("compiled") else "")


def packing_cache_md(rows: list[dict], m_rows: list[dict], spec: dict) -> str:
    pts = packing_cache_points(rows, m_rows)
    seeds = spec.get("seeds_cache_gain_pct") or {}
    if not pts:
        return ""
    body = [[p["gpu"], p["model"], p["seq_len"], _backend_label(p),
             fmt.joined(" / ", fmt.num(p['builds_on'], '.1f'), fmt.num(p['builds_off'], '.1f')), fmt.ms(p["m_ms"]),
             fmt.ms(p["predicted_ms"]), fmt.ms(p["predicted_device_ms"]), fmt.ms(p["seeds_ms"]),
             fmt.joined(" → ", fmt.ms(p['off_ms']), fmt.ms(p['on_ms'])),
             fmt.ms(p["measured_ms"]), ratio_cell(p["ratio"]), ratio_cell(p["ratio_device"]), gain_cell(p["gain_pct"]),
             fmt.signed_pct(seeds.get(p["model"])) if p["model"] in seeds else DASH]
            for p in pts]
    return ("### Cache on vs off: predicted and measured saving per step\n\n" + fmt.table(
        ["GPU", "model", "seq_len", "backend", "structure builds / step on / off", "m ms",
         "predicted (off − on)·m ms", "device part of it ms", "published (L−1)·m ms", "step ms off → on",
         "measured saving ms",
         "measured / predicted", "measured / device part", "cache gain", "published gain"], body)
        + "\n\nBuilds are counted (optim.packing counters over the measured steps), m comes from the "
          "packing bench (from lengths, same GPU type), the step times from this experiment's rows. "
          "A ratio above 1.5 means the uncached path costs more per rebuild in a training step than "
          "an isolated build: in a host-bound step every rebuild's host time (and its sync for "
          "max_seqlen) adds to the step, while m on an idle GPU measures the larger of device and "
          "host time once. A ratio below 0.5 on a GPU-bound step (spread near 1.00) is what host "
          "time that overlaps kernels already queued would give: there only the rebuilds' device "
          "time must add. The \"device part\" column tests that where the bench recorded m's "
          "device time (`m_device_ms`)."
        + _missing_m_note(pts) + _bound_summary(pts))


GPU_BOUND_SPREAD_PCT = 5.0  # both rows' p80/p20 within 5 %: the host keeps ahead of the GPU


def bound_split(pts: list[dict]) -> dict:
    """Which part of m a rebuild costs, by who bounds the step: the measured / predicted ratios of
    the GPU-bound pairs against the device part (``gpu``), the count of GPU-bound pairs whose device
    part is within their steps' p20-p80 band (``small``, too small to read), and the host-bound
    pairs' ratios against the whole m (``host``)."""
    gpu_bound = [p for p in pts if p["ratio_device"] is not None and p["noise_pct"] is not None
                 and p["noise_pct"] <= GPU_BOUND_SPREAD_PCT]
    # a saving smaller than the steps' own p20-p80 band cannot be read off their medians
    gpu = [p["ratio_device"] for p in gpu_bound if p["noise_ms"] is not None
           and p["predicted_device_ms"] > p["noise_ms"]]
    host = [p["ratio"] for p in pts if p["ratio"] is not None and p["noise_pct"] is not None
            and p["noise_pct"] > GPU_BOUND_SPREAD_PCT]
    return {"gpu": gpu, "small": len(gpu_bound) - len(gpu), "host": host}


def _bound_summary(pts: list[dict]) -> str:
    """``bound_split`` as sentences: medians and ranges of measured / predicted."""

    def span(vals):
        vals = sorted(vals)
        return f"median {vals[len(vals) // 2]:.2f}, range {vals[0]:.2f}–{vals[-1]:.2f}, {len(vals)} pairs"

    split = bound_split(pts)
    gpu, small, host = split["gpu"], split["small"], split["host"]
    if not gpu and not host:
        return ""
    out = ["\n\nBy who bounds the step (both rows' spread within "
           f"{GPU_BOUND_SPREAD_PCT:.0f} % reads as GPU-bound):"]
    if gpu:
        out.append(f"\n- GPU-bound: measured / device part {span(gpu)}. A rebuild costs the step its "
                   "kernels; its host time hides behind kernels already queued."
                   + (f" {small} more GPU-bound pairs predict a device part within their steps' "
                      "p20–p80 band, too small to read." if small else ""))
    if host:
        out.append(f"\n- Host-bound: measured / predicted (the whole m) {span(host)}. Here the host "
                   "time adds to the step, and the spread of these rows is the limit on what one pair says.")
    return "".join(out)


def _missing_m_note(pts: list[dict]) -> str:
    missing = sorted({(p["gpu"], int(fmt.number(p["seq_len"]) or 0)) for p in pts if p["m_ms"] is None})
    if not missing:
        return ""
    return (" The bench has no m for " + ", ".join(f"{t} tokens on {g}" for g, t in missing)
            + ", so those rows predict nothing.")


def _packed_variants(rows: list[dict]) -> list[str]:
    """Variants whose rows run an optim.packing backend (any cache or compile setting), named by the
    switch or, for optim.enable()'s defaults, which pick the backend themselves, by what ran."""
    return sorted({str(r["variant"]) for r in rows if r.get("variant") is not None
                   and ((r.get("switches") or {}).get("packing_backend") in STRUCTURE_COUNTER
                        or r.get("attn_implementation_used") == "optim_packed")})


def _ok_rows(rows: list[dict], model, seq_len, variant) -> list[dict]:
    return [r for r in rows if r.get("model") == model and r.get("seq_len") == seq_len
            and r.get("variant") == variant and r.get("status") == "ok"]


def packing_vs_stock_points(rows: list[dict], spec: dict) -> list[dict]:
    """Per (gpu, model, seq_len) with a row of ``spec["stock"]`` (the experiment's stock path): the
    best packed path (lowest step p50, median over repeats, of any packed variant) against it, and
    against ``spec["stock_compiled"]``. A stock row that failed (timed out, out of memory) keeps its
    point, with its status instead of a time."""
    stock_v, compiled_v = spec.get("stock"), spec.get("stock_compiled")
    if not stock_v:
        return []
    out = []
    for slug, g in steps_by_gpu(rows).items():
        points = {(r.get("model"), r.get("seq_len")) for r in g if r.get("variant") == stock_v
                  and r.get("model") and (fmt.stat(r, "step_ms") if r.get("status") == "ok" else r.get("status"))}
        for model, t in sorted(points, key=lambda k: (fmt.natural(k[0]), fmt.number(k[1]) or 0)):
            mine = [r for r in g if r.get("model") == model and r.get("seq_len") == t]
            stock, _, stock_failed = best_p50(mine, model, t, [stock_v])
            compiled, _, _ = best_p50(mine, model, t, [compiled_v] if compiled_v else [])
            best, variant, failed = best_p50(mine, model, t, _packed_variants(mine))
            out.append({"gpu": slug, "model": model, "seq_len": t, "stock_ms": stock,
                        "stock_compiled_ms": compiled, "best_ms": best, "best_variant": variant,
                        "failed": failed, "stock_failed": [_failure_text(r) for r in mine if r.get("variant")
                                                           == stock_v and r.get("status") != "ok"],
                        "ratio": stock / best if stock and best else None,
                        "compiled_ratio": compiled / best if compiled and best else None,
                        "stock_rows": _ok_rows(mine, model, t, stock_v),
                        "best_rows": _ok_rows(mine, model, t, variant) if variant else []})
        for p in out:  # (minutes apart, one code, one run?) of the two compared sides' rows
            p["run"] = run_verdict(p["stock_rows"] + p["best_rows"]) if p["best_rows"] else None
    return out


def _failure_text(r: dict) -> str:
    return f"{r.get('status')}: {r.get('message')}" if r.get("message") else str(r.get("status"))


def _plain_packed(rows: list[dict], backend: str) -> list[dict]:
    """Ok rows of ours running ``backend`` as enable gives it: cache on, layers not compiled, the
    full loss, no graph."""
    def sw(r):
        return r.get("switches") or {}
    return [r for r in rows if r.get("status") == "ok" and is_ours(r)
            and sw(r).get("packing_backend") == backend and sw(r).get("packing_cache", True) is not False
            and not sw(r).get("compile_layers") and not r.get("cuda_graph")
            and (r.get("loss_mode") or "full") == "full"]


def packing_targets_md(rows: list[dict], m_rows: list[dict], spec: dict) -> str:
    """The targets of ``spec`` (the experiment's ``[report.packing]``) from the sweep rows: best
    packed path vs the stock path, cache on vs off vs the published per-step gains, and the peak memory
    of the packed paths."""
    vs = packing_vs_stock_points(rows, spec)
    stock_v, compiled_v = spec.get("stock") or "stock", spec.get("stock_compiled") or "stock compiled"
    cache = packing_cache_points(rows, m_rows)
    gpus = {p["gpu"] for p in vs + cache}
    many = len(gpus) > 1
    targets = []

    sp = spec.get("speedup") or {}
    target_model, t0 = sp.get("model"), int(sp.get("seq_len") or 0)
    hits = [p for p in vs if p["model"] == target_model and p["seq_len"] == t0]
    if sp:
        want, ref = float(sp["min_ratio"]), sp.get("reference")
        goal = (f"best packed path ≥ {want:g}× faster than {stock_v}, {target_model} at {t0} tokens"
                + (f" (REFERENCE: {ref})" if ref else ""))
        for p in hits or [None]:
            if p is None or p["ratio"] is None:
                measured = ("not measured" if p is None else
                            fmt.Cell(f"{stock_v} {fmt.ms(p['stock_ms'])} ms, no packed row", {"stock_ms": p["stock_ms"]})
                            if p["stock_ms"] else f"{stock_v} {'; '.join(p['stock_failed'])}")
                targets.append([goal, measured, fmt.Cell(DASH, None)])
                continue
            measured = fmt.Cell(f"{fmt.times(p['ratio'])} ({stock_v} {fmt.ms(p['stock_ms'])} → {p['best_variant']} "
                                f"{fmt.ms(p['best_ms'])} ms); over {compiled_v} {fmt.times(p['compiled_ratio'])}",
                                {k: p[k] for k in ("ratio", "stock_ms", "best_variant", "best_ms", "compiled_ratio")})
            targets.append([goal + (f" ({p['gpu']})" if many else ""), measured,
                            fmt.Cell("met", True) if p["ratio"] >= want else fmt.Cell("not met", False)])

    for model, seeds in (spec.get("seeds_cache_gain_pct") or {}).items():
        goal = f"cache on saves ≥ the published {fmt.signed_pct(seeds)} per step ({model})"
        pts = [p for p in cache if p["model"] == model and p["gain_pct"] is not None]
        if not pts:
            targets.append([goal, "not measured", fmt.Cell(DASH, None)])
            continue
        # a gain smaller than the step-time spread of the two rows is not a measurement of the cache
        clear = [p for p in pts if p.get("noise_pct") is None or p["gain_pct"] > p["noise_pct"]]
        best = max(clear or pts, key=lambda p: p["gain_pct"])
        where = f"{_backend_label(best)}, {best['seq_len']} tokens" + (f", {best['gpu']}" if many else "")
        noise = f"; spread ±{best['noise_pct']:.0f}%" if best.get("noise_pct") is not None else ""
        if not clear:
            result = fmt.Cell("within noise: every gain is smaller than the step-time spread (p80/p20) of its "
                              "host-bound rows", None)
        elif best["gain_pct"] >= seeds:
            result = fmt.Cell("met", True)
        else:
            result = fmt.Cell("not met: see the measured / predicted column; the saving is "
                              "(builds_off − builds_on)·m", False)
        targets.append([goal, fmt.Cell(f"best {gain_cell(best['gain_pct'])} ({where}{noise})",
                                       {"gain_pct": best["gain_pct"], "backend": _backend_label(best),
                                        "seq_len": best["seq_len"], "spread_pct": best.get("noise_pct")}), result])

    parts = [] if not targets else ["### Packing targets\n\n" + fmt.table(["target", "measured", "result"], targets)
             + "\n\nThe result compares the measured value only; `–` means not judged. For the cache targets, "
               "measured is the best cache gain over backends and lengths in the cache on vs off table "
               "among those larger than the spread (p80/p20 − 1) of the two rows compared."]

    if vs:
        body = [[p["gpu"], p["model"], p["seq_len"],
                 fmt.ms(p["stock_ms"]) if p["stock_ms"] else "; ".join(p["stock_failed"]),
                 fmt.joined("", fmt.ms(p['best_ms']), note=p['best_variant']) if p["best_ms"]
                 else ("; ".join(p["failed"]) or "not run"),
                 fmt.times(p["ratio"]), fmt.ms(p["stock_compiled_ms"]), fmt.times(p["compiled_ratio"])] for p in vs]
        text = (f"#### Best packed path vs {stock_v}\n\n" + fmt.table(
            ["GPU", "model", "tokens", f"{stock_v} ms p50", "best packed ms p50 (variant)", f"{stock_v} / best",
             f"{compiled_v} ms p50", f"{compiled_v} / best"], body)
            + "\n\nBest packed = the lowest step p50 among variants with packing_backend sdpa, flex or "
              f"varlen, with any cache or compile setting, and optim.enable()'s defaults. {compiled_v} is {stock_v} with "
              "the same per-layer torch.compile (optim.regional), so its ratio shows what packing adds on "
              "top of compilation. Each ratio divides two rows of the same sweep file "
              "(`results/<experiment>/<gpu>.jsonl`).")
        for p in hits:
            if p["best_rows"]:
                note = run_note([(stock_v, p["stock_rows"]), (p["best_variant"], p["best_rows"])])
                where = f" on {p['gpu']}" if many else ""
                text += f" In the {target_model} {t0} comparison{where}, {note}"
        parts.append(text)

    peaks = []
    for slug, g in steps_by_gpu(rows).items():
        for model, t in sorted({(r.get("model"), r.get("seq_len")) for r in g},
                               key=lambda k: (fmt.natural(k[0]), fmt.number(k[1]) or 0)):
            at = [r for r in g if r.get("model") == model and r.get("seq_len") == t]
            by = {b: _plain_packed(at, b) for b in ("sdpa", "flex", "varlen")}
            if not any(by.values()):
                continue
            peak = {v: median_of(rs, lambda r: r.get("peak_allocated_gib")) for v, rs in by.items()}
            batch = median_of([r for rs in by.values() for r in rs], lambda r: r.get("batch_size"))
            mask = batch * fmt.number(t) ** 2 / GIB if batch and fmt.number(t) else None
            same = from_one_run([r for rs in by.values() for r in rs])
            diffs = fmt.joined(" / ", *(fmt.num(fmt.diff(peak["sdpa"], peak[b]), "+.3f") for b in ("flex", "varlen")))
            peaks.append([slug, model, t, *(fmt.num(peak[v], ".3f") for v in by), diffs,
                          fmt.num(mask, ".3f"), fmt.met(same)])
    if peaks:
        parts.append(
            "#### No T×T mask on the flex or varlen path\n\n"
            "`tests/test_gpu_packing.py` (a GPU test) asserts it: at 16384 tokens the flex and varlen paths "
            "allocate less than a quarter of a bool T×T mask. Below, the peak memory of the three packed "
            "paths (cache on, not compiled) side by side: the SDPA path holds a (B, T, T) mask, the others "
            "do not. The one run? column says yes when the rows were recorded within 30 minutes of each other "
            "running the same code (one code hash; one commit for rows older than the hash); peaks from "
            "different runs may differ for other reasons.\n\n" + fmt.table(
                ["GPU", "model", "tokens", "packed sdpa GiB", "packed flex GiB", "packed varlen GiB",
                 "sdpa − flex / sdpa − varlen GiB", "bool B·T² mask GiB", "one run?"], peaks))
    return "\n\n".join(parts)




ATTENTION_KERNELS = ("flex", "varlen", "varlen-split", "sdpa", "sdpa-causal", "sdpa-causal-split")


def attention_kernel_table(rows: list[dict]) -> str:
    """``python -m harness.bench.attention``'s rows: per geometry, row and document length, each
    kernel's forward + backward, and on rows of one document causal SDPA's lead over the fastest
    packed kernel (flex, varlen): what ``auto``'s choice for such rows rests on."""
    pts: dict[tuple, dict] = {}
    for r in rows_of_kind(rows, "attention_kernel"):
        key = (str(r.get("model")), r.get("heads"), r.get("kv_heads"), r.get("head_dim"),
               int(r.get("seq_len") or 0), int(r.get("doc_len") or 0))
        pts.setdefault(key, {})[r.get("backend")] = r
    if not pts:
        return ""

    def cell(r):
        if r is None:
            return DASH
        if r.get("status") != "ok":
            return str(r.get("status"))
        st = r.get("forward_backward_ms") or {}
        peak = r.get("forward_backward_peak_kib_per_token")
        held = f", {fmt.num(peak, '.1f')} KiB a token" if peak is not None else ""
        return f"{fmt.ms(st.get('p50'))} [{fmt.ms(st.get('p20'))}–{fmt.ms(st.get('p80'))}]{held}"

    kernels = [b for b in ATTENTION_KERNELS if any(b in by for by in pts.values())]  # a column per kernel measured
    body = []
    for key in sorted(pts, key=lambda k: (fmt.natural(k[0]), k[4], -k[5])):
        model, h, kv, d, n, doc = key
        by = pts[key]
        p50 = {b: (by[b].get("forward_backward_ms") or {}).get("p50") for b in by if by[b].get("status") == "ok"}
        packed = min((p50[b] for b in ("flex", "varlen") if p50.get(b)), default=None)
        lead = fmt.times(packed / p50["sdpa-causal"]) if packed and p50.get("sdpa-causal") else DASH
        body.append([model, f"{h}/{kv}×{d}", n, doc, *(cell(by.get(b)) for b in kernels), lead])
    return ("#### Attention kernels, forward + backward per layer call\n\n"
            + fmt.table(["model", "heads/KV × dim", "row tokens", "document tokens",
                         *(f"{b} ms" for b in kernels), "causal SDPA's lead over the fastest packed"], body)
            + f"\n\nOne attention call of {fmt.distinct(r.get('dtype') for r in rows_of_kind(rows, 'attention_kernel'))} "
              "q, k, v (batch 1), CUDA events after a warm-up, p50 [p20–p80]: "
              "`python -m harness.bench.attention`, and where measured the peak one forward + backward holds "
              "above its inputs, per token of the row. `sdpa-causal` (no mask, stock's kernel for a row of one "
              "document) runs only on such rows; `auto` runs it there (without sinks or sliding windows), and "
              "flex or varlen where a row holds boundaries; `varlen-split` is varlen with its backward one group "
              "of query heads at a time (switch `attention_split`, off by default), and `sdpa-causal-split` causal SDPA "
              "called so.")


# The report's parts (harness.measured)
def bench_tables(rows: list[dict], spec: dict) -> str:
    return "\n\n".join(t for t in (packing_tables(rows, spec), attention_kernel_table(rows)) if t)


def sweep_targets(steps: list[dict], rows: list[dict], spec: dict) -> str:
    m_rows = [r for r in rows if r.get("kind") == "packing_m"]
    return "\n\n".join(t for t in (packing_cache_md(steps, m_rows, spec), packing_targets_md(steps, m_rows, spec)) if t)
