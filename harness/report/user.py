"""The user's path beside the peers: per point, stock transformers + peft (eager and with compiled
layers), Liger-Kernel, Unsloth and ``optim.enable(model)`` as a user calls it, measured in one sweep, then every other variant of the
file; and the targets of ``[report.user]``.

The columns' variants are read from the roles the rows record (``harness.roles``): stock is the
experiment's baseline, stock + compile the variant of role ``stock-compiled``, Liger-Kernel the peer
its stack built, Unsloth the variant of role ``unsloth``, the user's path the variant of role ``user``;
the headline ratio is the user's path against the fastest of the four peers measured at the point.
``[report.user]`` may name any of them instead (``stock``, ``compiled``, ``liger``, ``unsloth``,
``user``: an older file's names, or a choice among several), and may list ``targets``, each
``{model, seq_len}`` with any of ``max_user_ms``, ``min_speedup_over_fastest`` (the fastest peer measured),
``max_peak_over_lowest`` (the lowest peak of the peers measured), ``min_speedup_over_liger``,
``max_peak_over_liger``, ``min_hfu`` and ``max_graphed_trainer_ms`` (the ``graphed`` row of
``python -m harness.bench.trainer`` stored with the experiment's rows). A target that names a
``variant`` judges that variant's row in place of the user's path, where it ran in the columns' run
(a setting such as memory first, against the same peers).
"""

from __future__ import annotations

from harness.measure.flops import hfu_of
from harness.report.fmt import DASH
from harness.report import defaults, fmt
from harness.report.runs import from_one_run, median_repeat, other_code, run_note, split_runs, steps_by_gpu
from harness.roles import role_of

ROLES = ("stock", "compiled", "liger", "unsloth", "user")
PEERS = ("stock", "compiled", "liger", "unsloth")  # what a user would run instead: the headline ratio is against the fastest
PEER_LABEL = {"stock": "stock", "compiled": "stock + compile", "liger": "Liger-Kernel", "unsloth": "Unsloth"}
_PLAYS = {"stock": lambda r: r.get("variant") == r.get("baseline_variant"),
          "compiled": lambda r: role_of(r) == "stock-compiled",
          "liger": lambda r: role_of(r) == "peer" and r.get("stack") == "liger",
          "unsloth": lambda r: role_of(r) == "unsloth",
          "user": lambda r: role_of(r) == "user"}


def variant_names(rows: list[dict], spec: dict) -> dict[str, tuple[str, ...]]:
    """Each column's variants: as ``spec`` names them (a name or a list), else every variant whose
    rows play it (empty where none does). A peer run both with and without checkpointing is two
    variants of one column: at each point the column shows the faster, as a user would choose.
    The user's path is one call: where several variants play it, the spec must choose one."""
    out = {}
    for col in ROLES:
        named = spec.get(col)
        found = tuple(sorted({str(r.get("variant")) for r in rows if _PLAYS[col](r)}))
        if named:
            out[col] = (named,) if isinstance(named, str) else tuple(named)
        else:
            out[col] = found if col in PEERS or len(found) == 1 else ()
    return out


def shown(variants: tuple[str, ...]) -> str:
    """A column's variants as a header names them."""
    return " / ".join(variants) if variants else DASH


def _best(rows: list[dict], variants) -> dict | None:
    """The column's row at a point: of its variants' ok rows (each variant's median repeat), the
    fastest; else a failure of one of them."""
    variants = (variants,) if isinstance(variants, str) else tuple(variants)
    picks = [r for v in variants if (r := median_repeat([x for x in rows if x.get("variant") == v]))]
    if picks:
        return min(picks, key=lambda r: fmt.stat(r, "step_ms"))
    mine = [r for r in rows if r.get("variant") in variants]
    return mine[0] if mine else None


def _side_by_side(rows: list[dict], names: dict[str, str | None]) -> list[dict]:
    """A point's rows from one run: the latest run (``runs.split_runs``) with an ok row of the
    user's path and of a peer, so the columns are measured side by side and a later run of some
    of them does not mix with an earlier one's; every row where no run has both."""
    def ok(run, col):
        return any(r.get("variant") in names[col] and r.get("status") == "ok" for r in run)

    paired = [run for run in split_runs(rows) if ok(run, "user") and any(ok(run, c) for c in PEERS)]
    return paired[-1] if paired else rows



def _latest(rows: list[dict], variants) -> dict | None:
    """The row of ``variants`` (a name or several) from the latest run that has one of them."""
    variants = (variants,) if isinstance(variants, str) else tuple(variants)
    runs = [run for run in split_runs(rows) if any(r.get("variant") in variants for r in run)]
    return _best(runs[-1], variants) if runs else None


def _ok(r: dict | None) -> bool:
    return (r or {}).get("status") == "ok" and fmt.stat(r, "step_ms") is not None


def _peak(r: dict | None) -> float | None:
    return fmt.number((r or {}).get("peak_allocated_gib")) if (r or {}).get("status") == "ok" else None


def _columns(at: list[dict], names: dict[str, tuple[str, ...]]) -> dict:
    """The columns at one point, from the latest run with an ok row of ``names["user"]`` beside a
    peer (``_side_by_side``), and the ratios a reader asks for."""
    mine = _side_by_side(at, names)
    ok_at = [r for r in at if r.get("status") == "ok"]
    # Each of a column's variants as that run has it (its median repeat, else its failure: the
    # newest word on it). A peer's variant the run lacks (a partial rerun, a crashed point) but
    # another run measured: its latest ok row, marked as another run's, so the fastest peer and the
    # lowest peak are of every variant measured here, whichever run holds it. A peer that only
    # failed in that run keeps its failure: an older row of its other variant does not stand in.
    got, low, elsewhere, peak_elsewhere = {}, {}, set(), set()
    for role, vs in names.items():
        cand = []
        for v in vs or ():
            here = [x for x in mine if x.get("variant") == v]
            if here:
                cand.append((median_repeat(here) or here[0], False))
            elif role in PEERS and (r := _latest(ok_at, v)) is not None:
                cand.append((r, True))
        if any(not apart for _, apart in cand) and not any(not apart and _ok(r) for r, apart in cand):
            cand = [c for c in cand if not c[1]]
        ok = [c for c in cand if _ok(c[0])]
        pick = min(ok, key=lambda c: fmt.stat(c[0], "step_ms")) if ok else (cand[0] if cand else (None, False))
        got[role] = pick[0]
        if pick[1]:
            elsewhere.add(role)
        peaked = [c for c in ok if _peak(c[0])]
        if peaked:
            low[role], apart = min(peaked, key=lambda c: _peak(c[0]))
            if apart:
                peak_elsewhere.add(role)
    ms = {role: fmt.stat(r, "step_ms") if (r or {}).get("status") == "ok" else None for role, r in got.items()}
    fastest = min((c for c in PEERS if ms[c]), key=lambda c: ms[c], default=None)
    peak = {role: _peak(low.get(role)) for role in got}
    return {
        "rows": got, "ms": ms, "peak": peak,
        "low": low,  # each role's row of its lowest peak (a peer's may be another variant than its fastest)
        "hfu": fmt.number(hfu_of(got["user"] or {})),
        "hfu_stale": bool((got["user"] or {}).get("hfu")) and hfu_of(got["user"] or {}) is None,
        "over_stock": ms["stock"] / ms["user"] if ms["stock"] and ms["user"] else None,
        "over_liger": ms["liger"] / ms["user"] if ms["liger"] and ms["user"] else None,
        "fastest_peer": fastest,  # of the peers' variants measured ok, in the user's run or another
        "elsewhere": elsewhere,  # peers whose row is from another run than the user's
        "peak_elsewhere": peak_elsewhere,  # peers whose lowest peak is from another run than the user's
        "over_fastest": ms[fastest] / ms["user"] if fastest and ms["user"] else None,
        "run": mine,
        "paired": mine is not at,  # some run has the user's column beside an ok peer
    }


def user_points(rows: list[dict], spec: dict) -> list[dict]:
    """Per (gpu, model, seq_len) with any of the columns' variants: their rows (median repeat) from
    one run (``_columns``), the ratios a reader asks for, and the other variants' rows."""
    names = variant_names(rows, spec)
    named = {v for vs in names.values() for v in vs}
    out = []
    for slug, g in steps_by_gpu(rows).items():
        keys = {(r.get("model"), r.get("seq_len")) for r in g if r.get("variant") in named}
        for model, t in sorted(keys, key=lambda k: (fmt.natural(k[0]), fmt.number(k[1]) or 0)):
            at = [r for r in g if r.get("model") == model and r.get("seq_len") == t]
            cols = _columns(at, names)
            others = sorted({r["variant"] for r in at if r.get("variant") not in named})
            out.append({
                "gpu": slug, "model": model, "seq_len": t, **cols,
                # each other variant from the latest run that has it, and whether that is the columns' run
                "others": {v: _latest(at, v) for v in others},
                "others_same_run": {v: any(r.get("variant") == v for r in cols["run"]) for v in others},
                "at": at, "names": names,
            })
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return DASH
    if r.get("status") == "skipped":
        return f"skipped: {str(r.get('message') or '')[:80]}"
    return fmt.spread(r, "step_ms")


def _marked(cell: str) -> str:
    """A peer's cell from another run than the user's path: its value kept, a dagger after."""
    return fmt.Cell(f"{cell} †", fmt.value(cell))


def _gib(x) -> str:
    return fmt.num(x, ".2f")


def _overlap(p: dict) -> bool:
    """Whether the one call's step and the fastest peer's overlap in their spreads at ``p``."""
    return bool(p["over_fastest"]) and fmt.spreads_overlap(p["rows"][p["fastest_peer"]], p["rows"]["user"])


def _over_fastest(p: dict) -> fmt.Cell:
    """The one call against the fastest peer, with ``fmt.OVERLAP`` where their spreads overlap."""
    cell = fmt.joined("", fmt.times(p["over_fastest"]), note=PEER_LABEL[p["fastest_peer"]])
    return fmt.Cell(f"{cell} {fmt.OVERLAP}", cell.value) if _overlap(p) else cell


def user_md(rows: list[dict], spec: dict, trainer_rows: list[dict] | None = None) -> str:
    """"## The user's path beside the peers": the three columns first, then the targets (a
    ``max_graphed_trainer_ms`` target reads ``harness.bench.trainer``'s rows)."""
    pts = user_points(rows, spec)
    if not pts:
        return ""
    names = {col: shown(v) for col, v in variant_names(rows, spec).items()}
    many = len({p["gpu"] for p in pts}) > 1
    body = []
    for p in pts:
        body.append([*([p["gpu"]] if many else []), p["model"], p["seq_len"],
                     *(_marked(_cell(p["rows"][role])) if role in p["elsewhere"] else _cell(p["rows"][role])
                       for role in ROLES),
                     fmt.joined(" / ", *(_gib(p["peak"][role]) + (" †" if role in p["peak_elsewhere"] else "")
                                         for role in ROLES)),
                     _over_fastest(p) if p["over_fastest"] else DASH,
                     fmt.times(p["over_stock"]) if p["over_stock"] else DASH,
                     fmt.times(p["over_liger"]) if p["over_liger"] else DASH,
                     fmt.fmt_pct(p["hfu"]) if p["hfu"] is not None else DASH])
    header = [*(["GPU"] if many else []), "model", "tokens", f"stock (`{names['stock']}`) ms",
              f"stock + compile (`{names['compiled']}`) ms", f"Liger-Kernel (`{names['liger']}`) ms",
              f"Unsloth (`{names['unsloth']}`) ms",
              f"optim.enable (`{names['user']}`) ms", "peak GiB stock / compile / liger / unsloth / user",
              "user vs the fastest peer", "user vs stock", "user vs liger", "user HFU"]
    text = ["## The user's path beside the peers",
            "Step time p50 [p20–p80] of forward + backward + AdamW, one fresh process per point, in one sweep: "
            "stock transformers + peft, the same with its decoder layers compiled, the same with Liger-Kernel's "
            "patches, Unsloth as its documentation builds a model, and `optim.enable(model)` with its defaults (the variant's `stack`; – where the file has no "
            "such variant). The headline ratio is against the fastest of the peers measured at that point. Peak "
            "is `torch.cuda.max_memory_allocated` over the measured steps, a peer's the lowest of its variants. † "
            "marks a peer's step or peak from a variant that the run of the user's path lacks, read from the "
            "latest run that measured it."
            + (" " + fmt.OVERLAP_NOTE if any(_overlap(p) for p in pts) else ""),
            fmt.table(header, body)]
    others = [[*([p["gpu"]] if many else []), p["model"], p["seq_len"],
               v + (f" ({note})" if (note := defaults.note(r)) else ""), _cell(r), _gib(_peak(r)),
               (fmt.times(p["ms"]["user"] / fmt.stat(r, "step_ms")) if p["others_same_run"][v] else "other run")
               if p["ms"]["user"] and _peak(r) is not None else DASH]
              for p in pts for v, r in p["others"].items()]
    if others:
        text += ["Every other variant of the file at those points (ablations of the defaults), each from the "
                 "latest run that has it; \"vs user\" only where that is the run of the columns above:",
                 fmt.table([*(["GPU"] if many else []), "model", "tokens", "variant", "ms", "peak GiB", "vs user"], others)]
    then = [f"{p['model']} at {p['seq_len']} tokens ({p['gpu']}): {note}"
            for p in pts if (note := defaults.note(p["rows"]["user"]))]
    if then or any(defaults.changed(r) for p in pts for r in p["others"].values()):
        text.append("A switch named beside a row (`switch=value, default now`) is one that the measuring code "
                    "defaulted to that value and the call now defaults otherwise: the row measured the old "
                    "default, and a rerun measures the call as it is."
                    + (" The user's path ran so at " + "; ".join(then) + "." if then else ""))
    for p in pts:
        labelled = [(str(r.get("variant")), [r]) for role in ROLES if (r := p["rows"][role]) is not None]
        if len(labelled) > 1:
            text.append(f"{p['model']} at {p['seq_len']} tokens ({p['gpu']}): " + run_note(labelled))
    goals = user_targets(pts, spec.get("targets") or [], trainer_rows or [])
    if goals:
        text += ["Targets:", fmt.table(["target", "measured", "met?"], goals)]
    return "\n\n".join(text)


def _graphed_trainer(trainer_rows: list[dict], model, seq_len, gpu, lora_rank=None) -> dict | None:
    """The newest ok GraphedTrainer row of ``harness.bench.trainer`` at the point: the same GPU, model,
    tokens and (where the point says) LoRA rank. None where the point has no GPU: a row of another
    card cannot judge it."""
    if gpu is None:
        return None
    ok = [r for r in trainer_rows if r.get("mode") == "graphed" and r.get("model") == model
          and r.get("tokens") == seq_len and r.get("status") == "ok" and r.get("gpu_slug") == gpu
          and fmt.number(r.get("ms")) is not None and (lora_rank is None or r.get("lora_rank") in (None, lora_rank))]
    # Trainer's defaults are what a user runs: a row that logged (and synced) every step, or set
    # other TrainingArguments, judges only where no such row exists, and says so
    usual = [r for r in ok if (r.get("logging_steps") or 1) != 1 and not r.get("trainer_args")]
    return max(usual or ok, key=lambda r: str(r.get("recorded_at") or "")) if ok else None


def _bench_note(r: dict, rows: list[dict]) -> str:
    """Where a bench row comes from: the command, and when and at which commit it ran ("dirty"
    where its tree held changes no clean row of ``rows`` at that commit measured with the same
    sources: other code than the commit's), and a log every step where it ran so."""
    sha = str((r.get("env") or {}).get("git_sha") or "")[:7]
    when = str(r.get("recorded_at") or "")[:10]
    return (f"`harness.bench.trainer`, {when}" + (f" at `{sha}`" if sha else "")
            + (" (dirty)" if sha and other_code(rows)(r) else "")
            + ("; Trainer logging every step" if (r.get("logging_steps") or 1) == 1 else "")
            + "".join(f"; {k}={v}" for k, v in sorted((r.get("trainer_args") or {}).items())))


def as_variant(p: dict, variant: str) -> dict | None:
    """The point with ``variant``'s row in the user's place, against the peers of its own latest
    run (and, as for the user's path, a peer that run lacks from another run); None where that run
    failed it or measured no peer beside it."""
    r = p["others"].get(variant)
    names = {**p["names"], "user": (variant,)}
    if r is None or r.get("status") != "ok":
        return None
    cols = _columns(p["at"], names)
    return {**p, **cols} if cols["paired"] and any(x is r for x in cols["run"]) else None


def not_run(p: dict | None) -> list[str]:
    """The peers with no row at the point (a failed run counts as run: it cannot be the fastest or
    the lowest); a skipped one (not installed) is not run."""
    if not p:
        return []
    return [PEER_LABEL[c] for c in PEERS
            if (r := p["rows"].get(c)) is None or (r.get("status") != "ok" and r.get("status") in (None, "skipped"))]


def user_targets(pts: list[dict], targets: list[dict], trainer_rows: list[dict] | None = None) -> list[list[str]]:
    """Each target as (goal, measured, met). One against the fastest or the lowest peer is judged
    only where every peer ran at the point; elsewhere its measured cell names the peers not run."""
    out = []
    for t in targets:
        model, seq_len = t.get("model"), t.get("seq_len")
        hits = [p for p in pts if p["model"] == model and p["seq_len"] == seq_len] or [None]
        for p in hits:
            where = f"{model} at {seq_len} tokens" + (f" ({p['gpu']})" if p else "")
            if t.get("variant"):
                p = as_variant(p, t["variant"]) if p else None
            subject = f"`{t['variant']}`" if t.get("variant") else "user"
            missing = not_run(p)
            unjudged = f"; {', '.join(missing)} not run" if missing else ""
            checks = []
            if "max_user_ms" in t:
                v = p and p["ms"]["user"]
                checks.append((f"{subject} ≤ {t['max_user_ms']:g} ms", fmt.Cell(f"{fmt.ms(v)} ms", v) if v else "not measured",
                               v <= t["max_user_ms"] if v else None))
            if "max_graphed_trainer_ms" in t:
                user_row = p and p["rows"].get("user")
                g = _graphed_trainer(trainer_rows or [], model, seq_len, p and p["gpu"],
                                     (user_row or {}).get("lora_rank"))
                v = fmt.number(g.get("ms")) if g else None
                checks.append((f"GraphedTrainer ≤ {t['max_graphed_trainer_ms']:g} ms per step",
                               fmt.Cell(f"{fmt.ms(v)} ms ({_bench_note(g, trainer_rows or [])})", v) if v else "not measured",
                               v <= t["max_graphed_trainer_ms"] if v else None))
            if "min_speedup_over_fastest" in t:
                v = p and p["over_fastest"]
                who = (PEER_LABEL[p["fastest_peer"]] + (", another run" if p["fastest_peer"] in p["elsewhere"] else "")
                       if v else "")
                checks.append((f"{subject} ≥ {t['min_speedup_over_fastest']:g}× faster than the fastest peer",
                               fmt.Cell(f"{v:.3f}× (vs {who}{unjudged})", v) if v else "not measured",
                               v >= t["min_speedup_over_fastest"] if v and not missing else None))
            if "max_peak_over_lowest" in t:
                u = p and p["peak"]["user"]
                low = min(((p["peak"][c], c) for c in PEERS if p["peak"][c]), default=(None, None)) if p else (None, None)
                v = u / low[0] if u and low[0] else None
                other = ", another run" if v and low[1] in p["peak_elsewhere"] else ""
                checks.append((f"{subject} peak ≤ {t['max_peak_over_lowest']:g}× the lowest peer's",
                               fmt.Cell(f"{v:.3f}× ({_gib(u)} vs {PEER_LABEL[low[1]]}'s {_gib(low[0])} GiB{other}{unjudged})",
                                        (v, u, low[0]))
                               if v else "not measured",
                               v <= t["max_peak_over_lowest"] if v and not missing else None))
            if "min_speedup_over_liger" in t:
                v = p and p["over_liger"]
                # three decimals: a ratio a hair under its target must not print as the target
                liger_apart = " (Liger-Kernel's row from another run)" if v and "liger" in p["elsewhere"] else ""
                checks.append((f"{subject} ≥ {t['min_speedup_over_liger']:g}× faster than Liger",
                               fmt.Cell(f"{v:.3f}×{liger_apart}", v) if v else "not measured",
                               v >= t["min_speedup_over_liger"] if v else None))
            if "max_peak_over_liger" in t:
                u, lg = (p["peak"]["user"], p["peak"]["liger"]) if p else (None, None)
                v = u / lg if u and lg else None
                liger_apart = ", another run" if v and "liger" in p["peak_elsewhere"] else ""
                checks.append((f"{subject} peak ≤ {t['max_peak_over_liger']:g}× Liger's",
                               fmt.Cell(f"{v:.3f}× ({_gib(u)} vs {_gib(lg)} GiB{liger_apart})", (v, u, lg)) if v else "not measured",
                               v <= t["max_peak_over_liger"] if v else None))
            if "min_hfu" in t:
                v = p and p["hfu"]
                unmeasured = ("recorded with an older FLOP count (the lm_head counted as recomputed): not judged"
                              if p and p.get("hfu_stale") else "not measured")
                checks.append((f"{subject} HFU ≥ {100 * t['min_hfu']:.0f}%", fmt.fmt_pct(v) if v else unmeasured,
                               v >= t["min_hfu"] if v else None))
            out += [[f"{goal}, {where}", measured, fmt.Cell(DASH if ok is None else ("met" if ok else "not met"), ok)]
                    for goal, measured, ok in checks]
    return out


_PEERS = {"stock": "stock Trainer + peft", "compiled": "stock Trainer, decoder layers compiled",
          "liger": "Trainer(use_liger_kernel=True)", "unsloth": "Trainer on Unsloth's FastLanguageModel",
          "unsloth-sft": "Unsloth's SFTTrainer"}
TRAINER_PEERS = {**_PEERS, **{f"{m}-nockpt": f"{label}, no checkpointing" for m, label in _PEERS.items()}}
TRAINER_LABELS = {**TRAINER_PEERS, "ours": "Trainer after optim.enable(model)",
                  "graphed": "optim.trainer.GraphedTrainer"}


def loss_diff(row: dict, stock: dict | None) -> float | None:
    """The largest relative difference of a run's per-step losses from those of the stock row shown
    beside it, read from both rows' losses (runs of one bench invocation or of two, the same
    documents per step); the row's own recorded figure where either row has none to compare."""
    mine, ref = row.get("losses"), (stock or {}).get("losses")
    if mine and ref and len(mine) == len(ref):
        pairs = [(fmt.number(a), fmt.number(b)) for a, b in zip(mine, ref)]
        if all(a is not None and b is not None for a, b in pairs):
            return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    return fmt.number(row.get("max_rel_loss_diff_vs_stock"))


def trainer_tables(rows: list[dict]) -> str:
    """``harness.bench.trainer``'s rows: stock Trainer, its compiled, Liger-Kernel and Unsloth peers, Trainer
    after ``optim.enable`` and GraphedTrainer per model, each against eager stock and against the
    fastest peer of the same run, with the loss curves' largest difference from stock."""
    found = [r for r in rows if r.get("kind") == "trainer"]
    if not found:
        return ""
    order = {m: i for i, m in enumerate(TRAINER_LABELS)}
    parts = ["#### transformers.Trainer",
             ("Optimizer-step time of `transformers.Trainer` on the same documents and seed "
              "(`python -m harness.bench.trainer`): median [p20–p80] after warm-up, CUDA events in a "
              "Trainer callback; host ms = the host's time per step from the step's begin to its end callback "
              "(median; a step time that follows it is host-bound, or waits on a host sync); "
              "× fastest peer = the fastest of the peer rows shown (stock, stock "
              "with its decoder layers compiled, Liger-Kernel through `use_liger_kernel`, Unsloth's "
              "model with its own offloaded checkpointing under Trainer and under TRL's SFTTrainer as "
              "Unsloth runs it, batching its own choice, each with checkpointing and without) over "
              "the row; loss diff = the largest relative difference of a step's loss from the stock "
              "row's in the same table. Every run starts from stock's base weights (Unsloth's loader "
              "reads them); Unsloth's adapters are its own draw, lora_B at zero, so its first step is "
              "stock's model and its later steps part by the adapters' draw.")]
    other_draw = False  # an Unsloth row whose loader drew its own weights
    by_model: dict[tuple, list[dict]] = {}
    for r in found:  # one table per card, workload and logging, each mode's newest row: never H200 over H100 stock
        # rows from before the bench recorded logging_steps logged every step
        extra = ", ".join(f"{k}={v}" for k, v in sorted((r.get("trainer_args") or {}).items()))
        key = (r.get("gpu_slug"), r.get("model"), r.get("tokens"), r.get("lora_rank"), r.get("logging_steps") or 1,
               extra)
        by_model.setdefault(key, []).append(r)
    many = len({k[0] for k in by_model}) > 1
    for (gpu, model, tokens, rank, logging, extra), rows_here in sorted(by_model.items(), key=lambda kv: str(kv[0])):
        newest: dict = {}
        for r in sorted(rows_here, key=lambda r: str(r.get("recorded_at") or "")):
            newest[r.get("mode")] = r
        group = list(newest.values())

        def ok_ms(r):
            return fmt.number(r.get("ms")) if r.get("status", "ok") == "ok" else None
        stock_row = next((r for r in group if r.get("mode") == "stock" and ok_ms(r)), None)
        stock = ok_ms(stock_row) if stock_row else None
        peer_ms = {r.get("mode"): ok_ms(r) for r in group if r.get("mode") in TRAINER_PEERS and ok_ms(r)}
        fastest = min(peer_ms, key=peer_ms.get) if peer_ms else None
        body = []
        for r in sorted(group, key=lambda r: order.get(r.get("mode"), 99)):
            ms, label = ok_ms(r), TRAINER_LABELS.get(r.get("mode"), r.get("mode"))
            if r.get("batching"):  # what Unsloth's SFTTrainer chose for itself
                label += f" ({r['batching']})"
            if ms is None:
                status = r.get("status", "ok")
                cell = f"{status}: {r['error']}" if r.get("error") else "no time recorded"
                body.append([label, cell if status != "ok" else "no time recorded", DASH, DASH, DASH, DASH, DASH, DASH])
                continue
            diff = loss_diff(r, stock_row)
            drawn = str(r.get("mode")).startswith("unsloth") and r.get("weights") != "stock"
            other_draw |= drawn and diff is not None
            body.append([label, f"{fmt.ms(ms)} [{fmt.ms(r.get('ms_p20'))}–{fmt.ms(r.get('ms_p80'))}]",
                         fmt.ms(r["issue_ms"]) if r.get("issue_ms") else DASH,
                         fmt.times(stock / ms) if stock else DASH,
                         fmt.times(peer_ms[fastest] / ms) if fastest else DASH, _gib(r.get("peak_gib")),
                         DASH if diff is None else f"{diff:.1e}" + (" ‡" if drawn else ""),
                         f"{r.get('steps')} ({r.get('warmup')} warm-up)"])
        card = f" on the {group[0].get('device_name') or gpu}" if many else ""
        peers_note = (f"; fastest peer: {TRAINER_LABELS[fastest]}" if fastest else "; no peer row")
        if fastest and set(peer_ms) != set(TRAINER_PEERS):
            peers_note += f" (of {', '.join(TRAINER_LABELS[m] for m in TRAINER_PEERS if m in peer_ms)} only)"
        logs = ("Trainer logging every step (a host sync each step)" if logging == 1
                else f"Trainer logging every {logging} steps") + (f", TrainingArguments {extra}" if extra else "")
        parts.append(f"**{model}**{card}: {tokens} tokens per step, LoRA r={rank}, {logs}{peers_note}"
                     + ("" if from_one_run(group) is not False else " (the modes' newest rows come from different runs)"))
        parts.append(fmt.table(["run", "ms/step", "host ms", "× stock", "× fastest peer", "peak GiB", "loss diff", "steps"],
                               body))
    if other_draw:
        parts.append("‡ Unsloth drew its own random weights (a row from before its loader read stock's, or "
                     "one whose disk had no room to hand them over): its loss diff compares two draws, not two "
                     "stacks on one model.")
    return "\n\n".join(parts)


# The report's parts (harness.measured)
def bench_tables(rows: list[dict], spec: dict) -> str:
    return trainer_tables(rows)


def lead(steps: list[dict], rows: list[dict], spec: dict, out_dir=None) -> str:
    """What a user gets beside the peers: the report's first section (it draws no figure)."""
    return user_md(steps, spec, trainer_rows=[r for r in rows if r.get("kind") == "trainer"])
