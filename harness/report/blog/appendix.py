"""The blog report's closing sections: H2D bandwidth per GPU against the PCIe ceiling, every
target the experiment files name (met or not, with its value), and how each figure was measured."""

from __future__ import annotations

from pathlib import Path

from harness.report import context as context_report
from harness.report import convergence as convergence_report
from harness.report import moe as moe_report
from harness.report import offload as offload_report
from harness.report import packing as packing_report
from harness.report import scaling as scaling_report
from harness.report import user as user_report
from harness.report import fmt
from harness.report.frames import STATISTIC
from harness.report.blog import figures
from harness.report.blog.style import embed, gpu_short


def hardware(rows: list[dict], fig_dir: Path, readme_dir: Path) -> str:
    bw = [r for r in rows if r.get("kind") == "bandwidth" and r.get("status") == "ok"]
    if not bw:
        return ""
    series: dict[tuple[str, str], dict[int, list[float]]] = {}
    ceilings = {}
    for r in bw:
        gpu = gpu_short(r.get("device_name"))
        if (g := fmt.number((r.get("gbps") or {}).get("p50"))) is not None:
            series.setdefault((gpu, str(r.get("memory"))), {}).setdefault(int(r["size_bytes"]), []).append(g)
        if (c := fmt.number(r.get("pcie_ceiling_gbps"))) is not None:
            ceilings[gpu] = c
    med = {k: [(s, sorted(v)[len(v) // 2]) for s, v in by.items()] for k, by in series.items()}
    body = []
    for gpu in sorted({g for g, _ in med}):
        best = {kind: max((g for _, g in med.get((gpu, kind), [])), default=None) for kind in ("pinned", "pageable")}
        c = ceilings.get(gpu)
        body.append([gpu, f"{best['pinned']:.1f}" if best["pinned"] else "–",
                     f"{best['pageable']:.1f}" if best["pageable"] else "–", f"{c:.1f}" if c else "–",
                     f"{100 * best['pinned'] / c:.0f} %" if c and best["pinned"] else "–"])
    fig = figures.bandwidth(med, ceilings, fig_dir / "h2d-bandwidth.png")
    return "\n\n".join(x for x in [
        "## Hardware: host-to-device bandwidth",
        "What offload's reload c is made of: `python -m harness bandwidth`'s copies, 1 MiB to 1 GiB, "
        "median of each size; the ceiling is the link's PCIe generation and width as NVML reports them "
        "(128b/130b encoding, one direction).",
        fmt.table(["GPU", "pinned GB/s (best size)", "pageable GB/s", "PCIe ceiling GB/s", "pinned / ceiling"], body),
        embed(fig, "host-to-device bandwidth against copy size", readme_dir)] if x)


def targets(per_experiment: dict[str, tuple[list[dict], dict]], note: str = "", extra: tuple[str, ...] = ()) -> str:
    """Every ``[report.*]`` target of the source experiments, judged from their rows; an experiment
    with targets but no rows says so. ``note`` follows the heading (the runs that disagree);
    ``extra`` are further judged subsections (the gate's)."""
    parts = ["## Targets: met or not"] + ([note] if note else [])
    for name, (rows, spec) in per_experiment.items():
        steps = [r for r in rows if r.get("kind") == "step"]
        texts = []
        if "user" in spec:
            pts = user_report.user_points(steps, spec["user"])
            goals = user_report.user_targets(pts, spec["user"].get("targets") or [],
                                             [r for r in rows if r.get("kind") == "trainer"])
            if goals:
                texts.append(fmt.table(["target", "measured", "met?"], goals))
        if "packing" in spec:
            m_rows = [r for r in rows if r.get("kind") == "packing_m"]
            texts.append(packing_report.packing_targets_md(steps, m_rows, spec["packing"]))
        if "offload" in spec:
            texts.append(offload_report.offload_targets_md(offload_report.offload_points(rows), spec["offload"]))
        if "moe" in spec:
            texts += [moe_report.moe_e2e_targets_md(steps, spec["moe"]), moe_report.moe_targets_md(rows, spec["moe"])]
        if "scaling" in spec:
            sc = spec["scaling"]
            pts = scaling_report.scaling_points(steps, sc)
            goals = scaling_report.scaling_targets(pts, sc.get("targets") or [], sc.get("ours", "ours"))
            if goals:
                texts.append(fmt.table(["target", "measured", "met?"], goals))
        if "context" in spec and (goals := spec["context"].get("targets")):
            texts.append(context_report.targets_md(context_report.by_variant(steps), goals))
        if any(r.get("kind") == "convergence" for r in rows):
            texts.append(convergence_report.targets_md(rows))
        texts = [t for text in texts if text for t in _target_tables(text)]
        if not rows:
            texts.insert(0, "No rows yet: every target of this file is **not measured**.")
        if texts:
            parts.append(f"### `{name}`\n\n" + "\n\n".join(texts))
    parts += [e for e in extra if e]
    return "\n\n".join(parts) if len(parts) > 1 + bool(note) else ""


def _target_tables(md: str) -> list[str]:
    """The tables of a per-experiment section whose first column is the target: the verdicts,
    without the tables of numbers they were judged from (those stay in the experiment's report),
    each under the heading it had there, in bold (it names the GPU where there are several)."""
    out, cur, heading = [], None, ""

    def close():
        if cur:
            out.append((f"**{heading}**\n\n" if heading else "") + "\n".join(cur))

    for line in md.splitlines():
        if line.startswith("|"):
            if cur is None:
                cur = [] if line.lower().startswith("| target |") else False
            if cur is not False:
                cur.append(line)
        else:
            close()
            cur = None
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
    close()
    return out


def _range(values) -> str:
    nums = sorted({int(v) for v in values if fmt.number(v) is not None})
    return "–" if not nums else str(nums[0]) if len(nums) == 1 else f"{nums[0]}–{nums[-1]}"


def methodology(rows: list[dict], commands: dict[str, list[str]]) -> str:
    envs = {}
    for r in rows:
        if r.get("kind") == "step" and r.get("env"):
            envs.setdefault(gpu_short(r.get("device_name")), []).append(r["env"])
    body = []
    for gpu, es in sorted(envs.items()):
        def vals(key, es=es):
            return ", ".join(sorted({str(e.get(key)) for e in es if e.get(key) is not None})) or "–"
        body.append([gpu, vals("torch"), vals("transformers"), vals("peft"), vals("liger_kernel"), vals("cuda"),
                     vals("driver"), f"{_range(e.get('sm_clock_mhz') for e in es)} / {vals('max_sm_clock_mhz')}",
                     f"Gen{vals('pcie_gen')} x{vals('pcie_width')}", vals("cpu_model")])
    steps = [r for r in rows if r.get("kind") == "step"]
    warm = ", ".join(sorted({str(r.get("warmup_steps")) for r in steps if r.get("warmup_steps") is not None}))
    meas = ", ".join(sorted({str(r.get("measured_steps")) for r in steps if r.get("measured_steps") is not None}))
    cmd_lines = [f"- `{name}`: " + "; ".join(f"`{c}`" for c in cmds) for name, cmds in commands.items() if cmds]
    return "\n\n".join([
        "## Methodology",
        f"Every step time is the {STATISTIC}, after {warm or '–'} warm-up steps, over {meas or '–'} measured "
        "steps, one fresh process per point. Models are built from their public configs with random "
        "weights (nothing is downloaded); data are generated packed rows. Speed-ups are ratios of "
        "medians measured in the same sweep on the same GPU; the \"one run\" column says whether the "
        "compared rows were recorded within 30 minutes of each other by the same code.",
        fmt.table(["GPU", "torch", "transformers", "peft", "Liger-Kernel", "CUDA", "driver", "SM clock / max MHz", "PCIe",
                "host CPU"], body)
        if body else "",
        "The commands that wrote the rows behind each section (each row records its own):",
        "\n".join(cmd_lines)])
