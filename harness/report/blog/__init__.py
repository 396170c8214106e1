"""``reports/README.md``: the report people read. A TL;DR in the published posts' form, one section per
optimization with its analytic check worked through on measured numbers, the user's path beside
stock and Liger-Kernel, hardware, every target, and the methodology; the per-experiment reports
stay as the appendix. Built from ``results/`` alone, as the plan (``experiments/blog.toml``) names
the experiments each part reads.

- ``plan``: the plan file; ``data``: rows → the four roles at each point; ``style``: colours and
  figure conventions; ``figures``: the PNGs; ``common``: shared tables;
- ``packing``, ``offload``, ``moe``: one section each; ``consistency``: one configuration that two runs
  measured differently; ``appendix``: hardware, targets, methodology.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from harness.measured import REGISTRY
from harness.report import spec as spec_file
from harness.report import cite, fmt, output
from harness.report.blog import appendix, common, consistency, data, gate, plan as plan_file
from harness.report.blog.style import ROLE_LABEL, embed
from harness.roles import PEERS
from harness.report.blog import figures
from harness.run import experiment as experiment_file

FIGURES = "figures"  # reports/figures/: the blog report's PNGs


def _specs(results_root, names, plan_dir: Path) -> tuple[dict, dict]:
    """The merged ``[report.*]`` tables of ``names`` (as kept beside their rows; else the file in
    the plan's folder, so targets not yet measured are still listed), and per name (rows, tables)."""
    merged, per = {}, {}
    for name in names:
        rows = data.load_rows(results_root, [name])
        tables, _ = spec_file.load(results_root, name, rows)
        if not tables and (f := plan_dir / f"{name}.toml").is_file():
            tables = experiment_file.load(f).report
        per[name] = (rows, tables)
        for k, v in tables.items():
            merged.setdefault(k, v)
    return merged, per


def _user_section(rows: list[dict], fig_dir: Path, readme_dir: Path) -> tuple[str, dict]:
    pts = data.role_points(rows)
    if not pts:
        return "", {}
    peers, figs = {}, cite.Figures()  # the TL;DR's figures, each keyed to its row
    for p in pts:
        ratio, fastest = p.over_fastest_peer()
        shown = [r for r in (*PEERS, "user") if p.ms(r)]
        peers.setdefault(p.gpu_name, []).append(
            f"{p.model} {p.seq_len}: " + ", ".join(f"{ROLE_LABEL[r]} {figs.ms(p.rows[r])}" for r in shown)
            + (f"; enable() {figs.ratio(p.rows[fastest], p.rows['user'])} the fastest of the others "
               f"({ROLE_LABEL[fastest]}{p.peers_short()})" if ratio else ""))
    peers["keys"] = figs
    parts = ["## The one call, beside what you would use instead",
             "`optim.enable(model)` with its defaults in a plain training loop, beside stock transformers + "
             "peft (eager, and with every decoder layer compiled where the sweep ran it), Liger-Kernel's "
             "patches and Unsloth (where the sweep ran it), in one sweep per GPU; \"best\" is the fastest setting of ours the sweep ran (CUDA graphs, "
             "for one), what the one call does not yet reach by itself.",
             common.peers_table(pts)]
    if caveat := common.stock_caveats(pts):
        parts.append(caveat)
    lengths = [len({p.seq_len for p in pts if p.model == m}) for m in {p.model for p in pts}]
    if max(lengths) > 1 and (fig := figures.speedup_vs_length(pts, fig_dir / "user-speedup.png", "step time")):
        parts.append(embed(fig, "the user's path: speed-up over stock", readme_dir))
    if table := common.split_table(pts):
        parts.append("### Where the time and memory go\n\n" + table)
    return "\n\n".join(parts), peers


def _tldr(heads: list[common.Headline], peers: dict, gpus: list[str]) -> str:
    body = [[h.optimization, h.bottleneck, *(h.measured.get(g, "not measured") for g in gpus), h.seeds or "–"]
            for h in heads]
    body.append(["`optim.enable(model)`, all of it", "the above, as a user gets it in one call",
                 *("; ".join(peers.get(g, [])) or "not measured" for g in gpus), "–"])
    keys = peers.get("keys")
    return ("## TL;DR\n\n" + fmt.table(["optimization", "bottleneck removed", *(f"measured, {g}" for g in gpus),
                                     "the published claim"], body)
            + (f"\n\n{cite.keys_comment(keys)}" if keys and keys.keys else ""))


@dataclass(frozen=True)
class BlogContext:
    """What a blog part may need beside its rows and ``[report]`` table."""

    fig_dir: Path
    reports_root: Path
    plan: plan_file.Plan


def build_blog(results_root: Path | str, reports_root: Path | str, plan_path: Path | str) -> Path:
    """Write reports/README.md and reports/figures/*.png from results/, as the plan says."""
    plan = plan_file.load(plan_path)
    reports_root = Path(reports_root)
    fig_dir = reports_root / FIGURES
    with output.Build(fig_dir) as build:  # the figures of an earlier build go once this one is whole
        plan_dir = plan.path.parent
        specs, per_exp = _specs(results_root, plan.experiments(), plan_dir)
        rows = {s: [r for name in names for r in per_exp[name][0]] for s, names in plan.sources.items()}
        user_md, peers = _user_section(rows.get("user", []), fig_dir, reports_root)
        sections, heads = [], []
        ctx = BlogContext(fig_dir, reports_root, plan)
        for name in plan.sources:  # each measured optimization's part, in the plan's order
            entry = REGISTRY.get(name)
            if entry is None or not entry.blog:
                continue
            text, head = importlib.import_module(entry.blog).part(rows.get(name, []), specs.get(name, {}), ctx)
            heads.append(head)
            if text:
                sections.append(text)
        all_rows = [r for rs in rows.values() for r in rs]
        disagree = data.disagreements(all_rows)
        gpus = sorted(set(data.devices(all_rows).values()))
        commands = {name: sorted({fmt.command(str(r.get("command"))) for r in per_exp[name][0] if r.get("command")})
                    for name in plan.experiments()}
        parts = [f"# {plan.title}",
                 f"Generated by `python -m harness report` from `results/` ({', '.join(f'`{n}`' for n in plan.experiments())}) "
                 f"as `experiments/{plan.path.name}` names them; do not edit by hand. Every figure is a row of those files; "
                 "the per-experiment reports under `reports/<experiment>/` hold every table. Published figures are "
                 "Unsloth and NVIDIA's, on their GPUs: from \"How to Make LLM Training Faster with Unsloth and NVIDIA\" "
                 "(May 2026) and Unsloth's guide to fine-tuning MoE models 12× faster.",
                 _tldr(heads, peers, gpus), consistency.tldr_note(disagree), user_md, *sections,
                 consistency.section(disagree),
                 appendix.hardware(all_rows, fig_dir, reports_root),
                 appendix.targets({n: per_exp[n] for n in plan.experiments()}, consistency.targets_note(disagree),
                                  (gate.targets(Path(results_root) / "gate", plan.gate),)),
                 appendix.methodology(all_rows, commands),
                 "## Appendix: every table\n\n" + "\n".join(f"- [`{n}`]({n}/README.md)" for n in plan.experiments()
                                                          if (reports_root / n / "README.md").is_file())]
        return build.finish(reports_root / "README.md", "\n\n".join(p.strip() for p in parts if p and p.strip()) + "\n")
