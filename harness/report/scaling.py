"""``## Scaling over GPUs``: ours beside stock, on one GPU and on N, from the rows of an experiment
with ``parallel = "fsdp2"`` and the ``[report.scaling]`` table of its file:

    [report.scaling]
    stock = "stock"              # the peer (stock FSDP2 + peft)
    ours = "user"                # optim.enable() as a user calls it
    [[report.scaling.targets]]
    model = "qwen3-8b"
    seq_len = 8192
    gpus = 2
    min_efficiency = 0.95        # ours keeps >= 95 % of its one-GPU tokens/s per GPU

Every point on N GPUs is also judged against the rule that ours beats stock by at least its
one-GPU ratio there. Peak memory is the largest rank's, so a model that needs sharding to fit says
how much each GPU holds.
"""

from __future__ import annotations

from harness.report import fmt
from harness.report.fmt import md_table

DASH = "-"


def _latest(rows: list[dict], **match) -> dict | None:
    hits = [r for r in rows if r.get("kind") == "step" and all(r.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok"


def _ms(r: dict | None) -> str:
    if r is None:
        return "not run"
    return fmt.Cell(f"{r['step_ms']['p50']:.1f}", r['step_ms']['p50']) if _ok(r) else r.get("status", "error")


def _gib(r: dict | None) -> str:
    if _ok(r) and r.get("peak_allocated_gib") is not None:
        return fmt.Cell(f"{r['peak_allocated_gib']:.1f}", r["peak_allocated_gib"])
    return fmt.Cell(DASH, None)


def _ratio(x) -> fmt.Cell:
    return fmt.Cell(f"{x:.3f}×", x) if x else fmt.Cell(DASH, None)


def _pct(x) -> fmt.Cell:
    return fmt.Cell(f"{100 * x:.1f}%", x) if x else fmt.Cell(DASH, None)


def _met(ok: bool) -> fmt.Cell:
    return fmt.Cell("met" if ok else "not met", ok)


def scaling_points(rows: list[dict], spec: dict) -> list[dict]:
    """Per (GPU type, model, seq_len, N > 1): ours and stock on N GPUs and on one."""
    stock, ours = spec.get("stock", "stock"), spec.get("ours", "user")
    keys = sorted({(r.get("gpu_slug") or "unknown", r["model"], r["seq_len"], r.get("gpus") or 1)
                   for r in rows if r.get("kind") == "step" and (r.get("gpus") or 1) > 1})
    out = []
    for slug, model, seq_len, n in keys:
        at = lambda variant, gpus: _latest(rows, gpu_slug=slug, model=model, seq_len=seq_len,  # noqa: E731
                                           variant=variant, gpus=gpus)
        p = {"gpu": slug, "model": model, "seq_len": seq_len, "gpus": n,
             "ours": at(ours, n), "stock": at(stock, n), "ours1": at(ours, 1), "stock1": at(stock, 1)}
        ratio = lambda a, b: (p[b]["step_ms"]["p50"] / p[a]["step_ms"]["p50"]  # noqa: E731
                              if _ok(p[a]) and _ok(p[b]) else None)
        p["speedup"], p["speedup1"] = ratio("ours", "stock"), ratio("ours1", "stock1")
        p["eff"] = p["ours"].get("scaling_efficiency") if _ok(p["ours"]) else None
        p["eff_stock"] = p["stock"].get("scaling_efficiency") if _ok(p["stock"]) else None
        out.append(p)
    return out


def scaling_md(rows: list[dict], spec: dict) -> str:
    pts = scaling_points(rows, spec)
    if not pts:
        return ""
    stock, ours = spec.get("stock", "stock"), spec.get("ours", "user")
    header = ["GPU", "model", "seq_len", "GPUs", f"{stock} ms", f"{ours} ms", "speedup", "speedup on 1 GPU",
              "at least the 1-GPU ratio?", f"{ours} efficiency", f"{stock} efficiency",
              f"{ours} peak GiB per GPU", f"{stock} peak GiB per GPU"]
    body = []
    for p in pts:
        kept = (fmt.Cell(DASH, None) if p["speedup"] is None or p["speedup1"] is None
                else _met(p["speedup"] >= p["speedup1"]))
        body.append([p["gpu"], p["model"], p["seq_len"], p["gpus"], _ms(p["stock"]), _ms(p["ours"]),
                     _ratio(p["speedup"]), _ratio(p["speedup1"]), kept, _pct(p["eff"]), _pct(p["eff_stock"]),
                     _gib(p["ours"]), _gib(p["stock"])])
    parts = ["## Scaling over GPUs: ours beside stock, on one GPU and on several",
             (f"Each point is one torchrun group, the model sharded with FSDP2. Step times are rank 0's; speedup is "
              f"{stock}'s step time over {ours}'s; efficiency is tokens/s per GPU over the same variant's on one GPU; "
              "peak memory is the largest rank's. A row that is not ok says so (`oom`: it does not fit)."),
             md_table(header, body)]
    goals = scaling_targets(pts, spec.get("targets") or [], ours)
    if goals:
        parts += ["### Targets", md_table(["target", "measured", "met?"], goals)]
    return "\n\n".join(parts)


def scaling_targets(pts: list[dict], targets: list[dict], ours: str) -> list[list[str]]:
    out = []
    for t in targets:
        hits = [p for p in pts if p["model"] == t.get("model") and p["seq_len"] == t.get("seq_len")
                and p["gpus"] == t.get("gpus", 2)] or [None]
        for p in hits:
            where = f"{t.get('model')} at {t.get('seq_len')} tokens on {t.get('gpus', 2)} GPUs" + (
                f" ({p['gpu']})" if p else "")
            if "min_efficiency" in t:
                v = p and p["eff"]
                out.append([f"{ours} keeps ≥ {100 * t['min_efficiency']:.0f}% of its one-GPU tokens/s per GPU, {where}",
                            _pct(v) if v else "not measured",
                            fmt.Cell(DASH, None) if not v else _met(v >= t["min_efficiency"])])
            if t.get("keeps_one_gpu_speedup"):
                n, one = (p["speedup"], p["speedup1"]) if p else (None, None)
                out.append([f"{ours} beats stock by at least its one-GPU ratio, {where}",
                            fmt.Cell(f"{n:.3f}× on {t.get('gpus', 2)} GPUs vs {one:.3f}× on 1", (n, one))
                            if n and one else "not measured",
                            fmt.Cell(DASH, None) if not (n and one) else _met(n >= one)])
            if t.get("trains"):
                r = p and p["ours"]
                out.append([f"{ours} trains sharded, its memory per GPU reported, {where}",
                            (fmt.Cell(f"ok, {_gib(r)} GiB peak per GPU", fmt.value(_gib(r))) if _ok(r)
                             else r.get("status", "error")) if r else "not measured",
                            fmt.Cell(DASH, None) if not r else _met(_ok(r))])
    return out


# The report's parts (harness.measured)
def lead(steps: list[dict], rows: list[dict], spec: dict, out_dir=None) -> str:
    return scaling_md(steps, spec)
