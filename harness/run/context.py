"""The longest trainable length per model and variant: a search over sweep points.

Each probe is one sweep point at one length: one fresh process, ``probe_warmup`` warm-up steps
and ``probe_steps`` measured ones (forward, backward and optimizer; fewer than a timing sweep
takes, since a probe asks whether the length trains, and a long one takes seconds a step), rows as the experiment's ``[data]`` draws them (a ``fixed``
document length at least the longest probe makes each row one document). A point that runs out
of memory is an ``oom`` row like any other, the GPU's or (killed by the kernel's OOM killer, ``memory_bound``
``host``) the host's; one past its time limit is an ``error`` row whose
message says it timed out. At such a length the stack does not train. Per model and variant the search doubles the length from
the file's first ``seq_lens`` entry until a probe does not train or ``max_len`` is reached, then
bisects between the longest length that trained and the shortest that did not, to ``resolution``
tokens. Once two lengths have trained, their peaks predict where the card fills (a line through
them, ``predict``), and the search goes there rather than doubling past it: a long probe costs
minutes (attention's time grows with the square of the length), so fewer of them. A point that fails otherwise (another ``error``, ``skipped``) ends that variant's search:
its row says why. Unsloth's search goes no further than the model's positions where its loader
would rescale RoPE past them (``length_cap``): it probes the window itself, not a length past it
that it would refuse.

Once every peer's search of a model has finished, each of ours' variants that trained longer is
probed once at the best peer's longest length too (``meet``), so the two step times there stand
side by side.

The rows are the sweep's, in ``results/<experiment>/<gpu>.jsonl``, each point identified by its
length as any sweep point is. A rerun reads the rows this code measured of the variant as the file
defines it now (``as_defined``) and goes on where the search stopped; ``stop_after_s`` starts no probe past that many seconds.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import results as res
from harness import row as rowmod
from harness.run import experiment as experiment_mod
from harness.run.experiment import Experiment

TRAINS, FAILS = ("ok",), ("oom", "timeout")
PROBE_FIELDS = ("seq_len", "warmup_steps", "measured_steps")  # what one search's probes differ in
MAX_LEN, RESOLUTION = 1 << 20, 1024  # the command's defaults: the longest length probed, the bisection's stop
FAILED_PROBE = "the probe at "  # how a search that ended on a refused or failed probe says so
ENDED_ON_A_FAILED_PROBE = 4  # the command's exit code when one did (and nothing worse happened): its row says why


# Past the longest length that trained, with none above it failed yet, a predicted limit (``predict``)
# moves the search at most this many times the length: a fit is a guess, and past it a probe is slow.
MAX_JUMP = 4
HEADROOM = 0.95  # of the card's memory, what a predicted length may fill (the allocator needs room)


def predict(peaks: dict[int, float], capacity_gib: float | None) -> int | None:
    """The length whose peak would fill ``HEADROOM`` of the card, on the line through the peaks of
    the two longest lengths that trained (a stack whose memory grows linearly in the length: the
    checkpoints and chunked MLPs and loss of every stack here; a T x T one grows faster, so the fit
    guesses long, and that probe fails and bounds the search). None with fewer than two peaks, no
    capacity, or a peak that does not grow."""
    if capacity_gib is None or len(peaks) < 2:
        return None
    (t1, p1), (t2, p2) = sorted(peaks.items())[-2:]
    slope = (p2 - p1) / (t2 - t1)
    if slope <= 0:
        return None
    return int(t2 + (HEADROOM * capacity_gib - p2) / slope)


def next_length(trained: list[int], failed: list[int], start: int, max_len: int, resolution: int,
                predicted: int | None = None) -> int | None:
    """The next length to probe, given the lengths that trained and those that did not; None when
    the search is over: the longest trainable length is known to ``resolution`` tokens, or is
    ``max_len`` or more, or is below ``resolution``. Until a length fails, the search doubles; with
    a ``predicted`` limit past the longest that trained, it goes there instead (rounded down to
    ``resolution``, at most ``MAX_JUMP`` times the length: doubling past the line would probe where
    the card is predicted full, the slowest probe of all), and with one at or below that length, a
    sixteenth of it up, so a failure bounds the search soon. A ``start`` still open (above every
    length that trained, below the failure above them, the search not over) is probed first: the
    length a rerun was told to start at (``--start``) is where it goes on."""
    lo = max(trained, default=None)
    hi = min((f for f in failed if lo is None or f > lo), default=None)
    if lo is None and hi is None:
        return start
    own = _next(lo, hi, max_len, resolution, predicted)
    if own is not None and (lo is None or start > lo) and (hi is None or start < hi) and start <= max_len:
        return start
    return own


def _next(lo: int | None, hi: int | None, max_len: int, resolution: int, predicted: int | None) -> int | None:
    """``next_length``'s own step from the longest that trained (``lo``) and the shortest failure
    above it (``hi``), one of them known."""
    if hi is None:
        if lo >= max_len:
            return None
        if predicted is not None:
            guess = predicted // resolution * resolution
            if guess > lo:  # at least a resolution up: a length not on the grid could leave a sliver
                return min(max(guess, lo + resolution), MAX_JUMP * lo, max_len)
            # the fit says full: a step up (a sixteenth, in resolution steps) finds the failure
            return min(lo + max(resolution, lo // 16 // resolution * resolution), max_len)
        return min(2 * lo, max_len)
    low = lo if lo is not None else 0
    if hi - low <= resolution:
        return None
    mid = (low + hi) // 2 // resolution * resolution
    return mid if mid > low and mid >= resolution else None


def setting(fields: dict) -> str:
    """A row's or a point's identity (``harness.row.identity``) less ``PROBE_FIELDS``: what every
    probe of one search shares (the variant's switches, the LoRA rank, dtype, data, ...)."""
    ident = rowmod.identity(fields)
    for k in PROBE_FIELDS:
        ident.pop(k, None)
    return json.dumps(ident, sort_keys=True, default=str)


def as_defined(exp: Experiment, model: str, variant: str, rows: list[dict]) -> list[dict]:
    """The rows of ``model`` and ``variant`` measured as ``exp`` defines that variant now: a probe
    of an edited file (another LoRA rank, other switches) says nothing of this search, as a sweep
    point of another identity resumes nothing. The probe settings (``--probe-warmup``,
    ``--probe-steps``) may differ: a length trains or not whatever they are."""
    points = [p for p in exp.points() if p.model == model and p.variant == variant]
    if not points:
        return []
    want = setting(dataclasses.asdict(points[0]))
    return [r for r in rows if r.get("model") == model and r.get("variant") == variant and setting(r) == want]


def outcomes(rows: list[dict], model: str, variant: str, code: str | None) -> dict[int, str]:
    """Length -> status of this model's and variant's probes measured by ``code`` (any code where
    None); the latest row of a length wins."""
    out: dict[int, str] = {}
    for r in rows:
        if (r.get("kind", "step") == "step" and r.get("model") == model and r.get("variant") == variant
                and (code is None or (r.get("env") or {}).get("code_id") == code)):
            status = r.get("status", "error")
            if status == "error" and str(r.get("message", "")).startswith("timed out"):
                status = "timeout"  # the sweep's row for a point past its time limit
            out[int(r["seq_len"])] = status
    return out


def peaks(rows: list[dict], model: str, variant: str, code: str | None) -> tuple[dict[int, float], float | None]:
    """Length -> peak allocated GiB of this model's and variant's probes that trained (by ``code``),
    and the card's memory as those rows recorded it."""
    out, capacity = {}, None
    for r in rows:
        if (r.get("kind", "step") == "step" and r.get("model") == model and r.get("variant") == variant
                and r.get("status") == "ok" and r.get("peak_allocated_gib")
                and (code is None or (r.get("env") or {}).get("code_id") == code)):
            out[int(r["seq_len"])] = float(r["peak_allocated_gib"])
            capacity = (r.get("env") or {}).get("memory_total_gib") or capacity
    return out, capacity


@dataclass
class Search:
    model: str
    variant: str
    probes: list[tuple[int, str]] = field(default_factory=list)  # (length, status) in the order run
    longest: int | None = None  # the longest length that trained
    stopped: str = ""  # why the search ended without an answer (an error row), or ""


def stack_cap(model: str, stack: str | None) -> int | None:
    """The longest length ``stack`` trains ``model`` at as the stacks beside it do (None: no limit):
    for Unsloth, the model's positions where its loader would rescale RoPE past them
    (``unsloth_stack.longest_length``). A search stops there, and a variant that trained there is
    as long as it goes (``harness.report.context.bounds``)."""
    if stack != "unsloth":
        return None
    from harness.run import unsloth_stack
    from harness.workload import models

    try:
        return unsloth_stack.longest_length(models.get(model).config())
    except KeyError:  # a row of a model the registry no longer has
        return None


def length_cap(exp: Experiment, model: str, variant: str) -> int | None:
    """``stack_cap`` of the variant's stack: its search probes up to that window, not past it to a
    refusal that would end the search below the window."""
    return stack_cap(model, exp.variant_stack.get(variant))


def pairs(exp: Experiment) -> list[tuple[str, str]]:
    """The (model, variant) pairs ``exp`` has points for, in its order (a variant limited to some
    models has no search for the others)."""
    return list(dict.fromkeys((p.model, p.variant) for p in exp.points()))


def state(exp: Experiment, model: str, variant: str, rows: list[dict], code: str | None, *, max_len: int,
          resolution: int, use_peaks: bool = True) -> tuple[int | None, str]:
    """Where a search stands on ``rows``: the length it probes next (None: it is over), and why it
    ended early ("" where it did not: bisected to ``resolution``, at ``max_len`` or the stack's
    ``length_cap``, or going on)."""
    max_len = min(max_len, length_cap(exp, model, variant) or max_len)
    rows = as_defined(exp, model, variant, rows)
    seen = outcomes(rows, model, variant, code)
    trained = [n for n, st in seen.items() if st in TRAINS]
    # a failure above every length that trained ends the search; one below (a probe at a peer's
    # longest, ``meet``) says nothing of how far this variant goes, nor one past ``max_len``,
    # where the search no longer goes (a row from before the cap)
    bad = {n: st for n, st in seen.items()
           if st not in TRAINS + FAILS and max(trained, default=0) < n <= max_len}
    if bad:
        n = min(bad)
        return None, f"{FAILED_PROBE}{n} tokens ended {bad[n]!r}: see its row"
    predicted = predict(*peaks(rows, model, variant, code)) if use_peaks else None
    # probes past max_len (a row from before a cap or a shorter --max-len) neither start nor bound it
    length = next_length(trained, [n for n, st in seen.items() if st in FAILS and n <= max_len],
                         min(exp.seq_lens[0], max_len), max_len, resolution, predicted)
    return (None if length in seen else length), ""


def search(exp: Experiment, model: str, variant: str, results_root: str | Path, *, max_len: int,
           resolution: int, run_point, rows_of, code: str | None, deadline: float | None = None,
           probe_warmup: int = 1, probe_steps: int = 2, use_peaks: bool = True,
           max_probes: int | None = None) -> Search:
    """One model's and variant's search (at most ``max_probes`` probes this run, where given). ``run_point(exp)`` runs the one-point experiment it is
    given (the sweep); ``rows_of()`` reads the results file again after it. ``use_peaks``: past the
    lengths that trained, go where their peaks predict the card fills (``predict``), not only double."""
    one = dataclasses.replace(experiment_mod.subset(exp, models=[model], variants=[variant]),
                              warmup_steps=probe_warmup, measured_steps=probe_steps)
    s = Search(model, variant)
    while True:
        length, s.stopped = state(exp, model, variant, rows_of(), code, max_len=max_len, resolution=resolution,
                                  use_peaks=use_peaks)
        if length is None:
            break
        if deadline is not None and time.monotonic() > deadline:
            s.stopped = "stopped: out of time (a rerun goes on)"
            break
        if max_probes is not None and len(s.probes) >= max_probes:
            s.stopped = f"stopped: {max_probes} probe(s) run, the limit (a rerun goes on)"
            break
        run_point(dataclasses.replace(one, seq_lens=[length]))
        status = outcomes(as_defined(exp, model, variant, rows_of()), model, variant, code).get(length)
        if status is None:  # the file limits this variant to other models or lengths, or the row is another code's
            s.stopped = (f"no row of this code at {length} tokens after its probe: the experiment file has no such "
                         "point for this variant, the row does not say which code measured it, or it is of another "
                         "setting (an OPTIM_* variable of another value)")
            break
        s.probes.append((length, status))
    seen = outcomes(as_defined(exp, model, variant, rows_of()), model, variant, code)
    s.longest = max((n for n, st in seen.items() if st in TRAINS), default=None)
    return s


def meet(exp: Experiment, searches: list[Search], *, run_point, rows_of, code: str | None,
         deadline: float | None = None, probe_warmup: int = 1, probe_steps: int = 2,
         max_probes: int | None = None) -> None:
    """Ours at the best peer's longest length: per model whose peers' searches here all ended
    (bisected to the resolution, trained at ``max_len``, or stopped by a probe that failed
    otherwise, a refusal or an error: none stopped on time or its probe limit), one probe of each of
    ours' variants (``harness.roles.OURS``) that trained at that length or longer but has no row
    there, appended to its search's probes. Ours' own search seldom lands on the peer's length, and
    without a row there the step times at the peer's limit cannot be set side by side (the target
    "ours faster than the best peer at its longest length"). A deadline or a search's probe limit
    holds here too."""
    rows = rows_of()
    for s, length in meetings(exp, searches, rows, code):
        if (deadline is not None and time.monotonic() > deadline) or \
                (max_probes is not None and len(s.probes) >= max_probes):
            continue
        one = experiment_mod.subset(exp, models=[s.model], variants=[s.variant])
        run_point(dataclasses.replace(one, warmup_steps=probe_warmup, measured_steps=probe_steps, seq_lens=[length]))
        status = outcomes(as_defined(exp, s.model, s.variant, rows_of()), s.model, s.variant, code).get(length)
        if status is None:  # as in ``search``: the file has no such point, or the row names no code
            s.stopped = f"no row of this code at {length} tokens after its meeting probe"
            continue
        s.probes.append((length, status))


def meetings(exp: Experiment, searches: list[Search], rows: list[dict], code: str | None) -> list[tuple[Search, int]]:
    """The probes ``meet`` runs on ``rows``: (ours' search, the best peer's longest length)."""
    from harness.roles import OURS, PEERS

    out = []
    for model in dict.fromkeys(s.model for s in searches):
        peers = [s for s in searches if s.model == model and exp.roles.get(s.variant) in PEERS]
        if not peers or any(s.stopped.startswith("stopped:") for s in peers) or not any(s.longest for s in peers):
            continue
        length = max(s.longest for s in peers if s.longest)
        for s in searches:
            if s.model != model or exp.roles.get(s.variant) not in OURS:
                continue
            seen = outcomes(as_defined(exp, model, s.variant, rows), model, s.variant, code)
            if length not in seen and any(n > length and st in TRAINS for n, st in seen.items()):
                out.append((s, length))
    return out


def left(exp: Experiment, rows: list[dict], code: str | None, *, max_len: int = MAX_LEN,
         resolution: int = RESOLUTION) -> list[tuple[str, str, int | None]]:
    """What a run of ``exp`` would still probe on ``rows``, read from them alone: (model, variant,
    None) per search not over, (model, variant, length) per probe ``meet`` owes."""
    out, searches = [], []
    for model, variant in pairs(exp):
        length, why = state(exp, model, variant, rows, code, max_len=max_len, resolution=resolution)
        trained = [n for n, st in outcomes(as_defined(exp, model, variant, rows), model, variant, code).items()
                   if st in TRAINS]
        # a search not over holds back the meeting, as one stopped on time does
        searches.append(Search(model, variant, longest=max(trained, default=None),
                               stopped=why or ("stopped: not over" if length is not None else "")))
        if length is not None:
            out.append((model, variant, None))
    return out + [(s.model, s.variant, n) for s, n in meetings(exp, searches, rows, code)]


def run(exp: Experiment, results_root: str | Path, *, max_len: int, resolution: int, command: str = "",
        stop_after_s: float | None = None, progress: bool = True, probe_warmup: int = 1,
        probe_steps: int = 2, use_peaks: bool = True, max_probes: int | None = None,
        keep_older: bool = False) -> list[Search]:
    """Every model and variant of ``exp``, one search each, in the file's order. A search goes on
    from the rows this code measured; ``keep_older``: from the rows any code measured (a search
    begun before a change to the sources or a library, whose probes still stand)."""
    from harness.measure.env import code_id
    from harness.run import sweep

    if resolution < 1 or max_len < exp.seq_lens[0] or probe_warmup < 0 or probe_steps < 1 or (max_probes is not None and max_probes < 1):
        raise ValueError(f"resolution, probe_steps and probes must be at least 1, probe_warmup at least 0, and "
                         f"max_len at least the first length {exp.seq_lens[0]}")
    if len(exp.gpus) != 1:  # each probe's row is matched to its search by the point's identity, one count's
        raise ValueError(f"a context search finds one card's longest length: experiment.gpus is {exp.gpus}; "
                         "give one count (a search per count is a file per count)")
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    slug = res.gpu_slug(sweep.detect_device_name(exp.device))
    path = res.results_path(results_root, exp.name, slug)
    code = None if keep_older else code_id()

    def run_point(one: Experiment) -> None:
        sweep.run(one, results_root, progress=progress, command=command)

    out = []
    for model, variant in pairs(exp):
        out.append(search(exp, model, variant, results_root, max_len=max_len, resolution=resolution,
                          run_point=run_point, rows_of=lambda: res.read_rows(path), code=code, deadline=deadline,
                          probe_warmup=probe_warmup, probe_steps=probe_steps, use_peaks=use_peaks,
                          max_probes=max_probes))
    meet(exp, out, run_point=run_point, rows_of=lambda: res.read_rows(path), code=code, deadline=deadline,
         probe_warmup=probe_warmup, probe_steps=probe_steps, max_probes=max_probes)
    return out
