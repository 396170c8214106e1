"""Where a step's time goes: the summaries `python -m harness profile` wrote under results/."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.report.fmt import DASH
from harness.report import fmt

# ---------------------------------------------------------------------------------------------
# Profiles: `python -m harness profile ... --out results/<experiment>/profiles/<gpu_slug>`

class ProfileFileError(ValueError):
    """A profile summary under results/ that cannot be read; the message names the file."""


PROFILE_DIR = "profiles"
# Kernel families by name, first match wins: what a step's GPU time is made of.
KERNEL_FAMILIES = (
    ("grouped GEMM (torch grouped_mm)", re.compile(r"GroupProblemShape|grouped_mm", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cublas|cutlass", re.I)),
    ("attention", re.compile(r"flex_attention|flash|attention|fmha|sdpa", re.I)),
    ("copies and fills", re.compile(r"memcpy|memset|copy_kernel|FillFunctor", re.I)),
)


def kernel_family(name: str) -> str:
    return next((fam for fam, rx in KERNEL_FAMILIES if rx.search(name)), "other (elementwise, reductions, indexing)")


def load_profiles(results_root: Path | str, experiment: str) -> list[dict]:
    """The ``*.summary.json`` files ``harness profile`` wrote under results/<experiment>/profiles/."""
    out = []
    for path in sorted((Path(results_root) / experiment / PROFILE_DIR).rglob("*.summary.json")):
        try:
            s = json.loads(path.read_text())
            s["phases"], s["top_kernels"], s["kernel_ms_total"]  # noqa: B018 (the fields the section reads)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileFileError(f"{path}: not a harness profile summary ({e})") from e
        out.append({**s, "_path": path})
    return out


def _share(x) -> str:
    """x in percent, unsigned: a part of a whole."""
    return fmt.Cell(f"{v:.1f}%", v) if (v := fmt.number(x)) is not None else fmt.Cell(DASH, None)


def profile_md(s: dict) -> str:
    """One profiled step: its phases, then its kernel time by family (per 1k tokens too)."""
    steps = int(s.get("steps") or 1)
    tokens = fmt.number(s.get("seq_len"))
    phases = fmt.table(["phase", "GPU span ms", "host span ms", "GPU busy", "launches", "host syncs"],
                    [[name, fmt.num(p.get("gpu_span_ms"), ".1f"), fmt.num(p.get("cpu_span_ms"), ".1f"),
                      _share(p.get("gpu_busy_pct")), p.get("launches", DASH), p.get("host_syncs", DASH)]
                     for name, p in s["phases"].items()])
    total = fmt.number(s["kernel_ms_total"]) or 0.0
    fams: dict[str, float] = {}
    for k in s["top_kernels"]:
        fam = kernel_family(str(k.get("name", "")))
        fams[fam] = fams.get(fam, 0.0) + (fmt.number(k.get("ms")) or 0.0)
    listed = sum(fams.values())
    rows = sorted(fams.items(), key=lambda kv: -kv[1])
    if total - listed > 0.05:
        rows.append((f"kernels outside the top {len(s['top_kernels'])}", total - listed))
    per_k = (lambda ms: fmt.num(ms / steps / tokens * 1024, ".1f")) if tokens else (lambda ms: DASH)
    kinds = fmt.table(["kernel family", "ms per step", "of kernel time", "ms per 1k tokens"],
                   [[fam, fmt.num(ms / steps, ".1f"), _share(100 * ms / total if total else None), per_k(ms)]
                    for fam, ms in rows]
                   + [["all kernels", fmt.num(total / steps, ".1f"), _share(100.0 if total else None), per_k(total)]])
    head = (f"#### {s.get('model')} at {s.get('seq_len')} tokens, `{s.get('variant')}` on "
            f"{s.get('device_name', s.get('device'))}")
    return (f"{head}\n\n{steps} profiled step(s), {s.get('profiled', 'eager steps')}, after warm-up; from "
            f"`results/{Path(*s['_path'].parts[-4:])}`{_measured_by(s.get('env'))}.\n\n{phases}\n\n{kinds}")


def _measured_by(env) -> str:
    """Which code measured a profile: its commit, and whether the tree had changes on top of it
    (a summary written before summaries recorded it says nothing)."""
    sha = (env or {}).get("git_sha") if isinstance(env, dict) else None
    if not sha:
        return ""
    dirty = " with uncommitted changes" if env.get("git_dirty") else ""
    return f", measured at commit `{str(sha)[:7]}`{dirty}"


def profile_sections(results_root: Path | str, experiment: str) -> list[str]:
    """"## Where the step's time goes (profiles)" from results/<experiment>/profiles/ ([] if none)."""
    profiles = load_profiles(results_root, experiment)
    if not profiles:
        return []
    return ["\n\n".join(["## Where the step's time goes (profiles)",
                          "Written by `python -m harness profile <experiment> ... --out "
                          f"results/{experiment}/{PROFILE_DIR}/<gpu_slug>`: one training step under "
                          "torch.profiler. GPU busy is the share of the phase's GPU span with a kernel "
                          "running; below 100 % the GPU waited for the host. Kernel families are told "
                          "apart by kernel name.", *(profile_md(s) for s in profiles)])]


