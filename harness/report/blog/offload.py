"""The offload section: c, g and (n−1)·min(c, g) against the measured saving of double over single
buffering, the bound PCIe puts on it, and the memory it costs and saves."""

from __future__ import annotations

from pathlib import Path

from harness.report import fmt
from harness.report.offload import offload_points
from harness.report.blog import figures
from harness.report.blog.common import Headline, gains_text, gib
from harness.report.blog.style import embed, gpu_short


def _pct(x) -> str:
    return "–" if x is None else f"{x:+.1f} %"


def newest_per_length(points: list[dict]) -> list[dict]:
    """One point per (model, seq_len): the bench run recorded last. A rerun sizes its batch from
    the layer-input target, so a point measured by older code at another batch is kept in the
    results (and the appendix's tables) but is not the answer the report gives for that length;
    a row with no ``recorded_at`` predates the field and counts as the oldest."""
    newest: dict[tuple, dict] = {}
    for p in points:
        key = (p["model"], p["seq_len"])
        when = str(p["summary"].get("recorded_at") or "")
        if key not in newest or when >= str(newest[key]["summary"].get("recorded_at") or ""):
            newest[key] = p
    return [p for p in points if newest[(p["model"], p["seq_len"])] is p]


def section(rows: list[dict], spec: dict, fig_dir: Path, readme_dir: Path) -> tuple[str, Headline]:
    head = Headline("Double-buffered reload of offloaded checkpoints",
                    "the GPU idle while a checkpointed layer input comes back over PCIe")
    seeds = spec.get("seeds") or {}
    head.seeds = ", ".join(f"{k.upper()} +{v.get('gain_pct'):g} %" for k, v in seeds.items()) + " steps/s (B200)" if seeds else ""
    per_gpu = {}
    for slug in sorted({r.get("gpu_slug") for r in rows if r.get("kind") in ("offload", "offload_summary")}):
        name = gpu_short(next(r.get("device_name") for r in rows if r.get("gpu_slug") == slug))
        per_gpu[name] = newest_per_length(offload_points([r for r in rows if r.get("gpu_slug") == slug]))
    if not per_gpu:
        return "", head
    parts = ["## 2. Double-buffered reload of offloaded checkpoints",
             "Each checkpointed layer input lives in pinned host memory. With one buffer the backward "
             "waits for each reload (c, bytes over the measured H2D bandwidth) before that layer's "
             "recompute and backward (g); with two, layer i's reload overlaps layer i+1's work, so "
             "T_double ≈ c + (n−1)·max(c, g) + g and the saving is (n−1)·min(c, g) for n reloaded "
             "layers (`harness.bench.offload`, every mode in one process; per GPU, model and length, "
             "the newest run)."]
    body, pairs = [], []
    for gpu, pts in per_gpu.items():
        for p in pts:
            body.append([gpu, p["model"], f"{p['seq_len']}×{p['batch']}", "–" if p["n"] is None else f"{p['n']:.0f}",
                         fmt.ms(p["c"]), fmt.ms(p["g"]), fmt.ms(p["predicted"]), fmt.ms(p["measured"]),
                         "–" if p["ratio"] is None else f"{p['ratio']:.2f}", _pct(p["double_over_single_pct"]),
                         _pct(p["bound_pct"]), gib(p["buffer_peak_gib"]), gib(p["saved_vs_none_gib"]),
                         _pct(p["double_vs_none_pct"])])
            pairs.append((gpu, p["predicted"], p["measured"], False, str(p["seq_len"])))  # colour: the length
    parts.append(fmt.table(["GPU", "model", "tokens × rows", "n", "c ms", "g ms", "(n−1)·min(c,g) ms",
                         "measured single − double", "measured / predicted", "double over single",
                         "bound", "2nd buffer GiB", "VRAM saved vs GPU ckpt, GiB", "double's step time over GPU ckpt"], body))
    if fig := figures.predicted_vs_measured(pairs, fig_dir / "offload-predicted-vs-measured.png", "saving per step (ms)"):
        parts.append(embed(fig, "offload: predicted against measured saving", readme_dir))
    cg = [(p["c"], p["g"], p["layer_gib"]) for pts in per_gpu.values() for p in pts if p["c"] and p["g"]]
    if cg:
        ratio = sorted(g / c for c, g, _ in cg)[len(cg) // 2]
        parts.append(
            "### Where it does not help\n\n"
            f"Here g is about {ratio:.0f}× c (median over the points): a layer input reloads over PCIe much "
            "faster than the GPU recomputes and back-propagates that layer, so each layer can hide only c, "
            "and the whole gain is bounded by (n−1)·c over the single-buffered step (the \"bound\" column). "
            "Double buffering pays where the reload is comparable to the layer's work: a slower link, "
            "shorter layers, or more bytes per layer. Against plain GPU checkpointing (the last column, "
            "+ = double is slower) offload buys memory, not speed.")
    for gpu, pts in per_gpu.items():
        head.measured[gpu] = gains_text([(f"{p['model']} {p['seq_len']}×{p['batch']}", p["double_over_single_pct"]) for p in pts
                                         if p["double_over_single_pct"] is not None]) + " steps/s over single"
    return "\n\n".join(parts), head


def part(rows: list[dict], spec: dict, ctx) -> tuple[str, Headline]:
    """Its part of the blog (harness.measured)."""
    return section(rows, spec, ctx.fig_dir, ctx.reports_root)
