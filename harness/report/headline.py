"""README.md's headline: the one call beside what a user would run instead, written from rows.

``python -m harness report`` rewrites the block between ``BEGIN`` and ``END`` in the README beside
the reports folder. Every figure in it is cited through ``cite.Figures``, keyed to its row's
statistic in the comment that closes the block. ``problems`` says what is wrong with a README: a key
that does not read back to its figure, a figure with no key, a block the rows no longer give, or a
measured figure outside the block (``tests/test_committed_results.py``).
"""

from __future__ import annotations

from pathlib import Path

from harness.report import cite, defaults, fmt
from harness.report.blog import data
from harness.report.blog.style import ROLE_LABEL
from harness.report.runs import other_code
from harness.roles import PEERS, role_of

BEGIN = "<!-- headline: written by `python -m harness report` from results/; edit harness/report/headline.py, not this block -->"
END = "<!-- /headline -->"
USER = ("user", "user-moe")  # the one call's own sweeps: the table
SWEEPS = ("packing", "moe")  # a sentence each: the one call's range against the fastest other


class HeadlineError(ValueError):
    """A README whose headline block is missing, malformed or not what the rows give."""


# ---------------------------------------------------------------------------------------------
# The block


def _workload(r: dict) -> str:
    return f"{r.get('model')}, LoRA r={r.get('lora_rank')}, {r.get('seq_len')} tokens"


def _cell(f: cite.Figures, p: data.RolePoint, role: str) -> str:
    r = p.rows.get(role)
    if r is None:
        return p.failed.get(role, "not run")
    return f.ms(r) + (" †" if p.apart_from_stock(role) else "") + (" ‡" if role in PEERS and _no_checkpointing(r) else "")


def _no_checkpointing(r: dict | None) -> bool:
    """A peer's row run with gradient checkpointing off (its variant set it so)."""
    return ((r or {}).get("switches") or {}).get("gradient_checkpointing") is False


def _overlaps(p: data.RolePoint) -> bool:
    """Whether the one call's step and the fastest peer's overlap in their spreads at ``p``."""
    _, fastest = p.over_fastest_peer()
    return bool(fastest) and fmt.spreads_overlap(p.rows.get(fastest), p.rows.get("user"))


def _table(f: cite.Figures, points: list[data.RolePoint], dirty) -> str:
    body = []
    for p in points:
        _, fastest = p.over_fastest_peer()
        user = p.rows.get("user")
        # the fastest of the peers that ran: say so where some did not
        vs = f"{f.ratio(p.rows[fastest], user)} ({ROLE_LABEL[fastest]}{p.peers_short()})" if fastest and user else "–"
        if user and _overlaps(p):
            vs += f" {fmt.OVERLAP}"
        # each peer's lowest peak over its variants: its checkpointed run where the faster one is not
        others = [p.low[r] for r in PEERS if r in p.low]
        low = min(others, key=lambda r: float(r["peak_allocated_gib"]), default=None)
        mem = (f"{f.gib(user)} / {f.gib(low)}" if user and low and user.get("peak_allocated_gib") is not None else "–")
        exp = str((user or p.rows.get("stock") or {}).get("experiment"))
        env = (user or {}).get("env") or {}
        code = f"`{str(env.get('git_sha') or '?')[:7]}`" + (" (dirty)" if dirty(user or {}) else "")
        if then := defaults.note(user):
            code += f" ({then})"
        body.append([p.gpu_name, _workload(user or p.rows["stock"]), *(_cell(f, p, r) for r in PEERS),
                     _cell(f, p, "user"), _best(f, p), vs, mem, code, f"[{exp}](reports/{exp}/README.md)"])
    return fmt.table(["GPU", "workload", *(ROLE_LABEL[r] for r in PEERS), "`optim.enable(model)`", ROLE_LABEL["best"],
                      "enable() against the fastest other", "peak, enable() / the lowest other", "commit", "report"], body)


def _best(f: cite.Figures, p: data.RolePoint) -> str:
    """Ours at its best (the fastest of the one call and the settings of optim beyond it) and its
    variant; "the defaults" where no other setting was faster."""
    best = p.rows.get("best")
    if best is None:
        return p.failed.get("best", "–")
    if role_of(best) == "user":  # the defaults themselves, whichever run's row was picked
        return "the defaults"
    return f"{_cell(f, p, 'best')} (`{best.get('variant')}`)"


def _range(f: cite.Figures, name: str, points: list[data.RolePoint]) -> str:
    """One sentence over a sweep: the one call against the fastest other at each point that measured
    both in one run, the points where every peer ran apart from those where some did not (there the
    fastest may be one not run); points whose two rows two runs measured are counted apart, and any
    of them where the other is faster is named."""
    from harness.report.runs import from_one_run

    pairs = [(ratio, p, fastest) for p in points for ratio, fastest in [p.over_fastest_peer()] if ratio]
    if not pairs:
        return ""
    one = sorted((x for x in pairs if from_one_run([x[1].rows[x[2]], x[1].rows["user"]]) is not False), key=lambda x: x[0])
    apart = sorted((x for x in pairs if from_one_run([x[1].rows[x[2]], x[1].rows["user"]]) is False), key=lambda x: x[0])
    full = [x for x in one if not x[1].peers_short()]
    partial = [x for x in one if x[1].peers_short()]

    def at(x) -> str:
        _, p, fastest = x
        return (f"{f.ratio(p.rows[fastest], p.rows['user'])} at {p.model} {p.seq_len} on the {p.gpu_name} "
                f"(against {ROLE_LABEL[fastest]}{p.peers_short()})")

    def span(xs) -> str:
        return f"{at(xs[0])}" if len(xs) == 1 else f"from {at(xs[0])} to {at(xs[-1])}"

    def plural(n: int) -> str:
        return f"{n} point{'s' if n > 1 else ''}"

    def more(n: int) -> str:
        return f"{n} more point{'s' if n > 1 else ''}"

    text = f"**{name}** (`experiments/{name}.toml`): "
    if full:
        text += (f"over the {plural(len(full))} one run measured beside every peer, `optim.enable(model)` against the "
                 f"fastest other ran {span(full)}.")
    if partial:
        missing = sorted({ROLE_LABEL[r] for _, p, _ in partial for r in PEERS if r not in p.peers_run()})
        lead = f" At {more(len(partial))}," if full else f"Over the {plural(len(partial))} one run measured,"
        text += (f"{lead} not every peer ran ({', '.join(missing)} missing at some): `optim.enable(model)` against "
                 f"the fastest that ran went {span(partial)}.")
    if slower := [x for x in one if x[0] < 1.0]:
        text += f" Slower than it at {len(slower)}: " + "; ".join(at(x) for x in slower) + "."
    if apart:
        text += (f" At {more(len(apart))} the fastest other was measured by another "
                 "run than the one call"
                 + (": slower than it at " + "; ".join(at(x) for x in apart if x[0] < 1.0) + "."
                    if any(x[0] < 1.0 for x in apart)
                    else ", none of them faster than it." if len(apart) > 1 else ", not faster than it."))
    return text


def _memory_first(f: cite.Figures, root: Path) -> str:
    """One sentence on each variant the user experiment holds to a memory target (a target naming a
    ``variant`` with ``max_peak_over_lowest``): its settings, its step against the fastest other and
    its peak against the lowest other, judged as the report's targets judge it."""
    from harness.report import spec as spec_file
    from harness.report import user as user_report

    if not (root / "user").is_dir():
        return ""
    rows = data.load_rows(root, ["user"])
    spec = spec_file.load(root, "user", rows)[0].get("user") or {}
    wanted = [(t["model"], t.get("seq_len"), t["variant"]) for t in spec.get("targets") or []
              if t.get("variant") and "max_peak_over_lowest" in t]
    steps = [r for r in rows if r.get("kind") == "step"]
    said = []
    for p in user_report.user_points(steps, spec):
        for model, seq_len, variant in wanted:
            v = user_report.as_variant(p, variant) if (p["model"], p["seq_len"]) == (model, seq_len) else None
            if not v or not v["fastest_peer"]:
                continue
            row, fastest = v["rows"]["user"], v["rows"][v["fastest_peer"]]
            low = min((v["low"][c] for c in user_report.PEERS if c in v["low"]),
                      key=lambda r: float(r["peak_allocated_gib"]), default=None)
            if low is None or row.get("peak_allocated_gib") is None:
                continue
            sw = row.get("switches") or {}
            settings = ", ".join(f"{k}={sw[k]!r}" for k in ("recompute", "offload", "mlp_chunk") if k in sw)
            apart = {c: ", another run" if c in v["elsewhere"] else "" for c in user_report.PEERS}
            low_role = next(c for c in user_report.PEERS if v["low"].get(c) is low)
            low_apart = ", another run" if low_role in v["peak_elsewhere"] else ""
            missing = user_report.not_run(v)
            short = f"; {', '.join(missing)} not run" if missing else ""
            said.append(f"`{variant}` ({settings}) at {model} {p['seq_len']} on the {data.gpu_short(str(row.get('device_name')))}: "
                        f"{f.ms(row)}, {f.ratio(fastest, row)} against the fastest other "
                        f"({user_report.PEER_LABEL[v['fastest_peer']]}{apart[v['fastest_peer']]}{short}), peak {f.gib(row)} "
                        f"against the lowest other's {f.gib(low)} ({user_report.PEER_LABEL[low_role]}{low_apart}{short})")
    if not said:
        return ""
    return ("**Memory first**, the same call with the switches that trade speed for memory (a variant of "
            "`experiments/user.toml`, each beside the peers of its own run): " + "; ".join(said) + ".")


def render(results_root: Path | str) -> str:
    """The block, markers and keys included, from results/ alone."""
    root = Path(results_root)
    f = cite.Figures()
    rows = data.load_rows(root, [e for e in USER if (root / e).is_dir()])
    user = [p for p in data.role_points(rows) if "user" in p.rows]
    parts = ["What `optim.enable(model)` gives with its defaults in a plain training loop, beside what a user "
             "would run instead, each row's roles from one sweep on the GPU named (`python -m harness sweep "
             "experiments/user.toml`, and `user-moe.toml`): the median step, and the one call's speed-up over the "
             "fastest of stock, stock + torch.compile, Liger-Kernel and Unsloth measured at that point. Ours, best "
             "setting is the fastest variant of optim at that point, the defaults or a setting beyond them, named "
             "beside its step. † marks a role "
             "measured by another run than the stock beside it."
             + (" ‡ marks a peer whose row shown had gradient checkpointing off; where a peer ran both ways, its "
                "column is the faster run and the memory column reads the lower peak."
                if any(_no_checkpointing(p.rows.get(r)) for p in user for r in PEERS) else "")
             + (" (dirty) marks a commit that the measured code had changes on top of." if any(other_code(rows)(p.rows["user"]) for p in user) else "")
             + (f" A switch named beside a commit (`{then}`) is one that the measured code defaulted to the "
                "first value and the call now defaults to the second: the row measured the old default."
                if (then := next((n for p in user if (n := defaults.note(p.rows["user"]))), "")) else "")
             + (" " + fmt.OVERLAP_NOTE if any(_overlaps(p) for p in user) else ""),
             _table(f, user, other_code(rows))]
    if line := _memory_first(f, root):
        parts.append(line)
    for name in SWEEPS:
        if (root / name).is_dir() and (line := _range(f, name, data.role_points(data.load_rows(root, [name])))):
            parts.append(line)
    return f"{BEGIN}\n\n" + "\n\n".join(parts) + f"\n\n{cite.keys_comment(f)}\n{END}"


def _span(text: str) -> tuple[int, int]:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise HeadlineError(f"the README holds {text.count(BEGIN)} headline begin and {text.count(END)} end markers; "
                            f"it needs one of each, in that order:\n{BEGIN}\n{END}")
    return text.index(BEGIN), text.index(END) + len(END)


def write(readme: Path | str, results_root: Path | str) -> bool:
    """Rewrite the README's block from the rows; True where it changed."""
    readme = Path(readme)
    text = readme.read_text()
    a, b = _span(text)
    new = text[:a] + render(results_root) + text[b:]
    if new != text:
        readme.write_text(new)
    return new != text


def loose_figures(text: str) -> list[str]:
    """Measured figures outside the headline block (code blocks and HTML comments aside)."""
    if BEGIN in text:
        a, b = _span(text)
        text = text[:a] + text[b:]
    return cite.loose_figures(text)


def problems(readme_text: str, results_root: Path | str) -> list[str]:
    """What is wrong with the README's figures: each key line must give the figure shown, each
    figure in the block must be keyed, the block must be what the rows give now, and no measured
    figure may stand outside it."""
    try:
        a, b = _span(readme_text)
    except HeadlineError as e:
        return [str(e)]
    block = readme_text[a:b]
    out = [f"README {p}" for p in cite.check_keys(block, results_root)]
    if block != render(results_root):
        out.append("the headline block is not what the rows give now: run python -m harness report")
    if loose := loose_figures(readme_text):
        out.append(f"measured figures outside the headline block (write them from rows, or cite the report): {loose[:10]}")
    return out
