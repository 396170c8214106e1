"""The sections every experiment's report has, per GPU type: results, plots, failures,
methodology, spread."""

from __future__ import annotations

import pandas as pd

from harness.report.fmt import is_known, fmt_ms, fmt_num, fmt_pct, md_table
from harness.report import fmt, runs
from harness.report.frames import PLOT_VARIANTS, STATISTIC, Section, points_frame, role_frame, speedup_frame
from harness.report.palette import ROLE_LABEL
from harness.report.plots import (
    embed_figure,
    plot_bandwidth,
    plot_memory,
    plot_phase_split,
    plot_speedup,
    plot_step_time,
    role_styles,
)

# ---------------------------------------------------------------------------------------------
# Sections: (df_steps, df_bw, rows, out_dir) -> markdown, all restricted to one GPU type.


def section_results(df_steps, df_bw, rows, out_dir) -> str:
    wide = points_frame(df_steps)
    if wide.empty:
        return "### Results\n\nNo step point finished ok on this GPU type."
    multi = _multi_gpu(wide)
    header = ["model", "seq_len", "batch", *(["GPUs"] if multi else []), "variant", "repeat", "step ms p50 [p20–p80]",
              "fwd ms", "bwd ms", "opt ms", "steps/s", "tokens/s", "peak alloc GiB", "peak reserved GiB", "MFU", "HFU",
              "p80/p20"]
    body = []
    for r in wide.itertuples():
        spread = r.step_ms_p80 / r.step_ms_p20 if is_known(r.step_ms_p20) and r.step_ms_p20 else float("nan")
        body.append([
            r.model, r.seq_len, r.batch_size, *([r.gpus] if multi else []), r.variant, r.repeat,
            fmt.Cell(f"{fmt_ms(r.step_ms_p50)} [{fmt_ms(r.step_ms_p20)}–{fmt_ms(r.step_ms_p80)}]", r.step_ms_p50),
            fmt_ms(r.forward_ms_p50), fmt_ms(r.backward_ms_p50), fmt_ms(r.optimizer_ms_p50),
            fmt_num(r.steps_per_s_p50, ".2f"), fmt_num(r.tokens_per_s_p50, ",.0f"),
            fmt_num(r.peak_allocated_gib_p50, ".2f"), fmt_num(r.peak_reserved_gib_p50, ".2f"),
            fmt_pct(r.mfu_p50, r.mfu_note), fmt_pct(r.hfu_p50, r.mfu_note), fmt_num(spread, ".2f"),
        ])
    note = "fwd/bwd/opt are p50 per phase; p80/p20 is the step-time spread."
    if multi:
        note += " On several GPUs: step times are rank 0's, tokens/s the group's, peak memory the largest rank's."
    return "### Results\n\n" + md_table(header, body) + "\n\n" + note


def _multi_gpu(frame) -> bool:
    """Whether a frame holds points on more than one GPU: only then do tables show the count."""
    return not frame.empty and (frame["gpus"].nunique() > 1 or int(frame["gpus"].max()) > 1)


def _plotted(df_steps):
    """(the frame the plots draw, its styles or None): every variant, or where more ran than a plot
    tells apart, the roles (``frames.role_frame``)."""
    roles = role_frame(df_steps)
    return (df_steps, None) if roles is None else (roles[0], role_styles())


def _roles_note(df_steps) -> str:
    """Under the first plot: which variant played each role, where the plots draw roles."""
    roles = role_frame(df_steps)
    if roles is None:
        return ""
    picks = roles[1]
    parts = []
    for series, label in ROLE_LABEL.items():
        here = picks[picks["series"] == series]
        if here.empty:
            continue
        by_variant: dict[str, list[str]] = {}
        for r in here.sort_values(["model", "seq_len", "batch_size", "gpus"]).itertuples():
            where = f"{r.model} {r.seq_len}" + (f" ×{r.gpus} GPUs" if r.gpus > 1 else "")
            by_variant.setdefault(r.variant, []).append(where)
        if len(by_variant) == 1:
            parts.append(f"{label}: `{next(iter(by_variant))}`")
        else:
            parts.append(f"{label}: " + "; ".join(f"`{v}` at {', '.join(w)}" for v, w in by_variant.items()))
    n = df_steps["variant"].nunique()
    return (f"\n\n{n} variants ran, more than the {PLOT_VARIANTS} lines a plot tells apart, so the plots draw "
            "the roles, each point's role played by its fastest variant (median over repeats): "
            + "; ".join(parts) + ". The tables list every variant.")


def section_step_time(df_steps, df_bw, rows, out_dir) -> str:
    frame, styles = _plotted(df_steps)
    path = plot_step_time(frame, out_dir / f"{fmt.gpu_slug(rows)}-step-time.png", styles)
    if not path:
        return ""
    return "### Step time vs sequence length\n\n" + embed_figure(path, "step time vs sequence length") + _roles_note(df_steps)


def section_phase_split(df_steps, df_bw, rows, out_dir) -> str:
    path = plot_phase_split(_plotted(df_steps)[0], out_dir / f"{fmt.gpu_slug(rows)}-phase-split.png")
    if not path:
        return ""
    return "### Forward / backward / optimizer split\n\n" + embed_figure(path, "phase split")


def section_memory(df_steps, df_bw, rows, out_dir) -> str:
    if df_steps.empty:
        return ""
    path = plot_memory(_plotted(df_steps)[0], out_dir / f"{fmt.gpu_slug(rows)}-peak-memory.png")
    body = embed_figure(path, "peak VRAM") if path else "No device memory peaks recorded (CPU run)."
    return "### Peak memory\n\n" + body


def section_speedup(df_steps, df_bw, rows, out_dir) -> str:
    if df_steps.empty:
        return ""
    sp = speedup_frame(df_steps)
    if sp.empty:
        return "### Speedup vs baseline\n\nNo variant has a matching ok baseline point."
    frame, styles = _plotted(df_steps)
    path = plot_speedup(sp if styles is None else speedup_frame(frame), out_dir / f"{fmt.gpu_slug(rows)}-speedup.png",
                        frame, styles)
    multi = _multi_gpu(sp)
    body = [[r.model, r.seq_len, r.batch_size, *([r.gpus] if multi else []), r.repeat, r.baseline_variant, r.variant,
             fmt_ms(r.baseline_step_ms_p50), fmt_ms(r.step_ms_p50), fmt.times(r.speedup)] for r in sp.itertuples()]
    header = ["model", "seq_len", "batch", *(["GPUs"] if multi else []), "repeat", "baseline", "variant",
              "baseline step ms p50", "variant step ms p50", "speedup"]
    same = "same model, seq_len, batch" + (", GPUs" if multi else "") + " and repeat"
    return ("### Speedup vs baseline\n\n" + embed_figure(path, "speedup vs baseline") + "\n\n" + md_table(header, body)
            + f"\n\nspeedup = baseline step ms p50 / variant step ms p50, {same}.")


def section_bandwidth(df_steps, df_bw, rows, out_dir) -> str:
    if df_bw.empty:
        on_cpu = bool(rows) and all((r.get("gpu_slug") or "cpu") == "cpu" for r in rows)
        return "### Host → device bandwidth\n\n" + ("No bandwidth rows: host → device copies are measured on a GPU."
                                                   if on_cpu else "No bandwidth rows for this GPU type.")
    path = plot_bandwidth(df_bw, out_dir / f"{fmt.gpu_slug(rows)}-h2d-bandwidth.png")
    body = []
    for r in df_bw.itertuples():
        known = is_known(r.pcie_ceiling_gbps) and is_known(r.p50)
        of_ceiling = fmt.Cell(f"{100 * r.p50 / r.pcie_ceiling_gbps:.0f}%", r.p50 / r.pcie_ceiling_gbps) if known else "n/a"
        gbps = fmt.Cell(f"{fmt_num(r.p50, '.2f')} [{fmt_num(r.p20, '.2f')}–{fmt_num(r.p80, '.2f')}]", r.p50)
        body.append([r.memory, fmt.size(r.size_bytes), gbps, of_ceiling])
    table = md_table(["memory", "size", "GB/s p50 [p20–p80]", "of PCIe ceiling"], body)
    return "### Host → device bandwidth\n\n" + embed_figure(path, "H2D bandwidth") + "\n\n" + table


def section_failed(df_steps, df_bw, rows, out_dir) -> str:
    failed = [r for r in rows if r.get("status") in ("oom", "error", "skipped")]
    if not failed:
        return "### Failed points\n\nNone."
    def key(r: dict) -> tuple:
        return (r.get("kind") or "", r.get("model") or "", int(r.get("seq_len") or 0),
                int(r.get("batch_size") or 0), r.get("variant") or "", int(r.get("repeat") or 0),
                r.get("memory") or "", int(r.get("size_bytes") or 0), r.get("status") or "")

    body = [[r.get("kind", ""), r.get("model", ""), r.get("seq_len", ""), r.get("batch_size", ""),
             r.get("variant", r.get("memory", "")), r.get("repeat", ""), r.get("status", ""),
             fmt.truncate(r.get("message", ""))] for r in sorted(failed, key=key)]
    return "### Failed points\n\n" + md_table(
        ["kind", "model", "seq_len", "batch", "variant", "repeat", "status", "message"], body)


def section_methodology(df_steps, df_bw, rows, out_dir) -> str:
    envs = [r.get("env") or {} for r in rows]
    steps = [r for r in rows if r.get("kind") == "step"]

    def env(key: str, unit: str = "") -> str:
        return fmt.distinct(e.get(key) for e in envs) + unit if any(e.get(key) is not None for e in envs) else "unknown"

    dirty = runs.other_code(rows)

    def git(e):
        sha = e.get("git_sha")
        if not sha:
            return None
        return sha[:12] + (" (dirty)" if dirty({"env": e}) else "")

    def pcie(gen_key, width_key):
        return fmt.distinct(f"Gen{e.get(gen_key)} x{e.get(width_key)}" for e in envs
                       if e.get(gen_key) is not None or e.get(width_key) is not None)

    device = fmt.distinct([e.get("device_name") for e in envs] + [r.get("device_name") for r in rows])
    on_cpu = bool(rows) and all((r.get("gpu_slug") or "cpu") == "cpu" for r in rows)
    repeats = {r.get("repeat") for r in steps if r.get("repeat") is not None}
    parts = [
        f"Measured on {device} (device count {env('device_count')}), host {env('hostname')}, {env('platform')}.",
        f"Driver {env('driver')}, CUDA {env('cuda')}, Python {env('python')}, torch {env('torch')}, "
        f"transformers {env('transformers')}, peft {env('peft')}; git {fmt.distinct(git(e) for e in envs)}.",
        f"PCIe link {pcie('pcie_gen', 'pcie_width')} (max {pcie('pcie_max_gen', 'pcie_max_width')}); "
        f"SM clock {env('sm_clock_mhz', ' MHz')} (max {env('max_sm_clock_mhz', ' MHz')}), memory clock "
        f"{env('mem_clock_mhz', ' MHz')}, power limit {env('power_limit_w', ' W')}.",
        f"Each point runs in its own fresh process: {fmt.distinct(r.get('warmup_steps') for r in steps)} warm-up steps, "
        f"then {fmt.distinct(r.get('measured_steps') for r in steps)} measured steps, "
        f"{len(repeats) if repeats else 'unknown'} repeat(s); dtype {fmt.distinct(r.get('dtype') for r in steps)}, "
        f"LoRA rank {fmt.distinct(r.get('lora_rank') for r in steps)}, adapters in "
        f"{fmt.distinct(r.get('lora_dtype', 'fp32') for r in steps)} (fp32: peft's default upcast).",
        f"Statistic: {STATISTIC}.",
        _collector_sentence(steps),
        "Speedups are ratios of medians measured side by side in one run, on the same "
        + ("CPU: they check the pipeline, not GPU speed." if on_cpu else "GPU type."),
    ]
    return "### Methodology\n\n" + " ".join(parts)


def _collector_sentence(steps) -> str:
    """What Python's cycle collector did in the measured steps, from the rows' ``collector``."""
    as_run = sum(1 for r in steps if r.get("collector") == "as_run")
    if not as_run:
        return "The Python garbage collector is collected, frozen and disabled for the measured steps."
    said = ("The Python garbage collector runs in the measured steps as each stack leaves it, as in a user's "
            "own loop (`collector = \"as_run\"`; `optim.enable` leaves it as it is unless `gc_threshold` "
            "raises its young threshold)")
    if as_run == len(steps):
        return said + "."
    return (f"{said} in {as_run} of {len(steps)} step rows; in the others it is collected, frozen and disabled "
            "for the measured steps.")


def spread_points(rows) -> tuple[list[dict], dict[bool, list[float]], list[str]]:
    """Two spreads per ok step point: within a run (p80/p20 of the step samples, its worst repeat)
    and run to run (p80/p20 of the per-repeat medians, each repeat a fresh process; None with one
    repeat). Returns the points, the worst of each for steps replayed as CUDA graphs (True) and
    eager (False) as [run to run, within], and the points that compiled while measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "step" and r.get("status") == "ok":
            key = (r["model"], r["seq_len"], r.get("batch_size"), r["variant"], int(r.get("gpus") or 1))
            groups.setdefault(key, []).append(r)
    points, compiling = [], []
    worst = {False: [0.0, 0.0], True: [0.0, 0.0]}
    for key in sorted(groups):
        reps = runs.newest_code(groups[key])  # other code's rows of the point are not its repeats
        graphed = bool(reps[0].get("cuda_graph"))
        medians = [r["step_ms"]["p50"] for r in reps]
        within = max(r["step_ms"]["p80"] / r["step_ms"]["p20"] for r in reps)
        worst[graphed][1] = max(worst[graphed][1], within)
        run_to_run = None
        if len(medians) > 1:
            q = pd.Series(medians).quantile([0.2, 0.8])
            run_to_run = q[0.8] / q[0.2]
            worst[graphed][0] = max(worst[graphed][0], run_to_run)
        counts = [r["compiled_graphs_per_step"] for r in reps if r.get("compiled_graphs_per_step") is not None]
        compiled = max((sum(1 for c in cs if c) for cs in counts), default=None)
        if compiled:
            compiling.append(f"{key[0]} T={key[1]} `{key[3]}`")
        points.append({"key": key, "graphed": graphed, "medians": medians, "run_to_run": run_to_run,
                       "within": within, "compiled": compiled,
                       "measured": max((len(cs) for cs in counts), default=None)})
    return points, worst, compiling


def section_spread(df_steps, df_bw, rows, out_dir) -> str:
    """``spread_points`` as a table, then the worst spreads: host-bound steps show host jitter
    within a run; run to run is what a regression gate compares."""
    points, worst, compiling = spread_points(rows)
    if not points:
        return ""
    body = []
    for p in points:
        key, medians = p["key"], p["medians"]
        body.append([key[0], key[1], key[2], key[3] + (f" ({key[4]} GPUs)" if key[4] > 1 else ""), len(medians),
                     fmt.Cell(" / ".join(f"{m:.1f}" for m in medians), tuple(medians)),
                     fmt.Cell(f"{p['run_to_run']:.3f}", p["run_to_run"]) if p["run_to_run"] is not None
                     else fmt.Cell("n/a (1 repeat)", None), fmt.num(p["within"], ".3f"),
                     "–" if p["compiled"] is None else fmt.Cell(f"{p['compiled']} of {p['measured']}",
                                                                (p["compiled"], p["measured"]))])
    header = ["model", "seq_len", "batch", "variant", "repeats", "step ms p50 per repeat",
              "run-to-run p80/p20", "within-run p80/p20 (worst repeat)", "measured steps that compiled"]

    def worst_text(graphed: bool) -> str:
        run, step = worst[graphed]
        return (f"worst run-to-run spread {run:.3f}, worst within-run spread {step:.3f}" if run
                else f"worst within-run spread {step:.3f}")

    lines = []
    if any(p["graphed"] for p in points):
        lines.append(f"- Steps replayed as CUDA graphs (`cuda_graph = true`, optim.graphs): {worst_text(True)}. "
                     "The host issues one launch per phase, so these spreads are the GPU's.")
        if not all(p["graphed"] for p in points):
            lines.append(f"- Eager steps: {worst_text(False)}. A host-bound eager step (the GPU waits "
                         "for Python between kernels) varies with the host CPU; the graphed twin of the "
                         "same point shows what the GPU itself does.")
    else:
        lines.append(worst_text(False).capitalize() + ".")
    if compiling:
        lines.append(f"- torch.compile made graphs during measured steps of {', '.join(compiling)}: those steps "
                     "were timed with a compile, so the median is not the steady state (a shape or value that "
                     "changes per batch recompiles; `TORCH_LOGS=recompiles` names the guard).")
    summary = "\n".join(lines)
    return "### Spread\n\n" + md_table(header, body) + "\n\n" + summary


def section_scaling(df_steps, df_bw, rows, out_dir) -> str:
    """Points on several GPUs (``parallel`` = "fsdp2"): per GPU, against the same point on one."""
    multi = [r for r in rows if r.get("kind") == "step" and r.get("status") == "ok" and r.get("world_size")]
    if not any(r["world_size"] > 1 for r in multi):
        return ""
    body = []
    for r in sorted(multi, key=lambda r: (r["model"], r["seq_len"], r["variant"], r["world_size"])):
        ranks = r.get("per_rank") or []
        coll = [x.get("collective_ms") for x in ranks if is_known(x.get("collective_ms"))]
        eff = r.get("scaling_efficiency")
        body.append([r["model"], r["seq_len"], r["variant"], r["world_size"], fmt_ms(r["step_ms"]["p50"]),
                     fmt_num(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt_pct(eff) if is_known(eff) else "-",
                     fmt.joined(" / ", *(fmt_num(x.get("peak_allocated_gib"), ".2f") for x in ranks)) if ranks else "-",
                     fmt.joined(" / ", *(fmt_ms(c) for c in coll)) if coll else "-"])
    header = ["model", "seq_len", "variant", "GPUs", "step ms p50 (rank 0)", "tokens/s per GPU",
              "scaling efficiency", "peak alloc GiB per rank", "NCCL kernel ms per rank"]
    note = ("Each point is one torchrun group, the model sharded with FSDP2. Scaling efficiency is tokens/s "
            "per GPU over the same point's tokens/s on one GPU (FSDP2 on one GPU); NCCL kernel ms is the "
            "collectives' GPU time in one more, profiled step, whether or not compute overlapped them.")
    return "### Scaling over GPUs\n\n" + md_table(header, body) + "\n\n" + note


# Run in order for each GPU type; append to register more (each returns markdown or "" to skip).
SECTIONS: list[Section] = [
    section_results,
    section_step_time,
    section_phase_split,
    section_memory,
    section_speedup,
    section_scaling,
    section_spread,
    section_bandwidth,
    section_failed,
    section_methodology,
]


# ---------------------------------------------------------------------------------------------
# Entry points


def summary_counts(rows: list[dict]) -> dict[str, int]:
    """What the report's first line counts: ok step points, failed points, ok bandwidth points."""
    return {"ok": sum(1 for r in rows if r.get("kind") == "step" and r.get("status") == "ok"),
            "failed": sum(1 for r in rows if r.get("status") in ("oom", "error", "skipped")),
            "bandwidth": sum(1 for r in rows if r.get("kind") == "bandwidth" and r.get("status") == "ok")}


def summary(experiment: str, rows: list[dict], df_steps: pd.DataFrame) -> str:
    steps = [r for r in rows if r.get("kind") == "step"]
    n = summary_counts(rows)
    models = fmt.distinct(r.get("model") for r in steps)
    variants = fmt.distinct(r.get("variant") for r in steps)
    gpus = fmt.distinct(r.get("gpu_slug") for r in rows)
    return (f"{n['ok']} ok step points ({models}; variants {variants}), {n['failed']} failed, "
            f"{n['bandwidth']} bandwidth points, on {gpus}.")


