"""The packing section: builds per step counted, m measured, (builds_off − builds_on)·m against
the measured saving, and the speed-up over stock by length."""

from __future__ import annotations

from pathlib import Path

from harness.report import fmt
from harness.report.packing import packing_cache_points
from harness.report.blog import figures
from harness.report.blog.common import Headline, gains_range, peers_table, split_table
from harness.report.blog.data import role_points
from harness.report.blog.style import embed, gpu_short

BACKEND = "flex"  # the cache pair shown in the section: flex is what stock's packed path runs


def section(rows: list[dict], spec: dict, fig_dir: Path, readme_dir: Path) -> tuple[str, Headline]:
    head = Headline("Packed-sequence metadata, built once per batch",
                    "the mask / BlockMask / cu_seqlens rebuilt in every layer and every recompute")
    seeds = spec.get("seeds_cache_gain_pct") or {}
    head.seeds = ", ".join(f"{m} +{v:g} %" for m, v in seeds.items()) + " per step (B200)" if seeds else ""
    names = {r.get("gpu_slug"): gpu_short(r.get("device_name")) for r in rows}
    pts = [p for p in packing_cache_points(rows, rows) if not p["compiled"]]
    if not pts and not rows:
        return "", head
    parts = ["## 1. Packed-sequence metadata, built once per batch"]
    layers = {r.get("model"): fmt.number(r.get("num_layers")) for r in rows if r.get("kind") == "step"}
    parts.append(
        "With gradient checkpointing an uncached path builds the packing structure in every layer's "
        "forward and again in its recompute, so the builds are counted per step rather than assumed "
        "to be L−1. The predicted saving is (builds off − builds on)·m, with m the measured cost of one "
        "build (`harness.bench.packing`); the published (L−1)·m stands beside it. Measured is the step time "
        f"of the cache off minus on, layers not compiled, `{BACKEND}` backend.")
    body = []
    for p in pts:
        if p["backend"] != BACKEND:
            continue
        body.append([names.get(p["gpu"], p["gpu"]), p["model"], fmt.number(layers.get(p["model"])) and int(layers[p["model"]]),
                     p["seq_len"], f"{p['builds_off']:.0f} → {p['builds_on']:.0f}" if p["builds_off"] is not None else "–",
                     fmt.ms(p["m_ms"]), fmt.ms(p["predicted_ms"]), fmt.ms(p["seeds_ms"]), fmt.ms(p["measured_ms"]),
                     f"{p['ratio']:.2f}" if p["ratio"] is not None else "–",
                     f"{p['gain_pct']:+.1f} %" if p["gain_pct"] is not None else "–",
                     f"±{p['noise_pct']:.1f} %" if p["noise_pct"] is not None else "–"])
    if body:
        parts.append(fmt.table(["GPU", "model", "L", "tokens", "builds/step off → on", "m ms", "predicted ms",
                             "published (L−1)·m", "measured ms", "measured / predicted", "step gain", "noise"], body))
    scatter = figures.predicted_vs_measured(
        [(names.get(p["gpu"], p["gpu"]), p["predicted_ms"], p["measured_ms"],
          p["noise_pct"] is not None and p["gain_pct"] is not None and abs(p["gain_pct"]) <= p["noise_pct"],
          p["backend"], p["one_run"] is False) for p in pts],
        fig_dir / "packing-predicted-vs-measured.png", "saving per step (ms)")
    if scatter:
        parts.append(embed(scatter, "packing: predicted against measured saving", readme_dir)
                     + f"\n\nEvery model, length, backend (sdpa, flex, varlen) and GPU: {len(pts)} cache pairs. "
                     "Colour is the backend, marker shape the GPU; a hollow marker is a pair whose step gain is "
                     "within its step times' p20–p80 spread, a black cross one whose cache-on and cache-off rows "
                     "two runs measured.")
    rp = role_points(rows)
    if rp:
        parts.append("### Beside stock and the peer\n\n" + peers_table(rp))
        if fig := figures.speedup_vs_length(rp, fig_dir / "packing-speedup.png", "step time"):
            parts.append(embed(fig, "packing: speed-up over stock by length", readme_dir))
        heads = [p for p in rp if p.seq_len == max(q.seq_len for q in rp if q.model == p.model)
                 and p.model == _headline_model(rp)]
        if table := split_table(heads):
            parts.append("### Where the time and memory go\n\n" + table)
    # where it does not help: the saving inside the step's own noise
    flat = [p for p in pts if p["gain_pct"] is not None and p["noise_pct"] is not None
            and p["gain_pct"] <= p["noise_pct"]]
    if flat:
        items = "; ".join(f"{p['model']} T={p['seq_len']} {p['backend']} on {names.get(p['gpu'], p['gpu'])} "
                          f"({p['gain_pct']:+.1f} % against ±{p['noise_pct']:.1f} % noise)" for p in flat)
        parts.append("### Where it does not help\n\n"
                     f"{len(flat)} of {len(pts)} cache pairs gain no more than the step's own spread: {items}. "
                     "The builds run on the host, so where the GPU's work per layer outlasts them (long rows, "
                     "wide models) they can hide behind kernels already queued; these pairs do not tell that "
                     "apart from noise. The varlen metadata costs under 1 ms a build, so it has little to save.")
    for gpu in sorted({p["gpu"] for p in pts}):
        head.measured[names.get(gpu, gpu)] = gains_range(
            [p for p in pts if p["gpu"] == gpu and p["backend"] == BACKEND], "per step") + f" ({BACKEND})"
    return "\n\n".join(parts), head


def _headline_model(points) -> str:
    """The model the split table shows: the one most lengths ran."""
    models = [p.model for p in points]
    return max(sorted(set(models)), key=models.count)


def part(rows: list[dict], spec: dict, ctx) -> tuple[str, Headline]:
    """Its part of the blog (harness.measured)."""
    return section(rows, spec, ctx.fig_dir, ctx.reports_root)
