"""Which rows come from one run: recording times and code hashes."""

from __future__ import annotations

from harness.report import fmt

SAME_RUN_MINUTES = 30  # rows recorded further apart than this come from different sweep runs


def median_of(rows: list[dict], get) -> float | None:
    vals = sorted(v for r in rows if (v := fmt.number(get(r))) is not None)
    return vals[len(vals) // 2] if vals else None


def median_repeat(rows: list[dict]) -> dict | None:
    """The ok repeat whose median step is the median of the repeats' (the upper one of an even
    count, as ``median_of`` takes it): one rule for every report that shows a point's repeats."""
    ok = sorted((r for r in rows if r.get("status") == "ok" and fmt.stat(r, "step_ms") is not None),
                key=lambda r: fmt.stat(r, "step_ms"))
    return ok[len(ok) // 2] if ok else None




def recorded_at(r: dict):
    from datetime import datetime, timezone

    try:
        t = datetime.fromisoformat(str(r.get("recorded_at")))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def other_code(rows: list[dict]):
    """A test of a row: whether it ran other measuring code than its commit's. Its tree was dirty
    (``env.git_dirty``) and no clean row of that commit recorded the same ``env.code_sha``. A sweep
    once read its own rows, appended to the tracked results/, as changes: every row after a run's
    first said dirty. The first, clean, row of that run vouches for the others of the same code."""
    clean = {(e.get("git_sha"), e.get("code_sha")) for r in rows
             if (e := r.get("env") or {}).get("git_dirty") is False and e.get("code_sha")}

    def test(r: dict) -> bool:
        e = r.get("env") or {}
        return bool(e.get("git_dirty")) and (e.get("git_sha"), e.get("code_sha")) not in clean

    return test


def code_ids(rows: list[dict]) -> set:
    """What ran: the hash of the measuring code where rows record it (env.code_sha), else the commit."""
    return {code_of(r) for r in rows} - {None}


def code_of(r: dict):
    """The code that measured one row (``code_ids``' key): env.code_sha, else the commit."""
    e = r.get("env") or {}
    return e.get("code_sha") or e.get("git_sha")


def newest_code(rows: list[dict]) -> list[dict]:
    """The rows measured by the code that measured the most recently recorded of them (rows without
    a recording time count as oldest): one point's repeats, without other code's rows of it."""
    if not rows:
        return []
    order = sorted(range(len(rows)), key=lambda i: (recorded_at(rows[i]) is not None,
                                                     recorded_at(rows[i]) or 0, i))
    code = code_of(rows[order[-1]])
    return [r for r in rows if code_of(r) == code]


def from_one_run(rows: list[dict]) -> bool | None:
    """True when the rows were recorded within SAME_RUN_MINUTES of each other running the same code
    (one code hash, or one commit for rows without one), False when not, None when a time is missing."""
    times = [recorded_at(r) for r in rows]
    if not rows or None in times:
        return None
    return (max(times) - min(times)).total_seconds() <= SAME_RUN_MINUTES * 60 and len(code_ids(rows)) <= 1


def run_note(labelled: list[tuple[str, list[dict]]]) -> str:
    """One sentence: when (and at which commit) each compared row was recorded, and whether that
    reads as one run."""
    rows = [r for _, rs in labelled for r in rs]
    if not rows:
        return ""

    def seen(rs):
        when = fmt.distinct(r.get("recorded_at") for r in rs)
        shas = fmt.distinct(str(s)[:8] for r in rs if (s := (r.get("env") or {}).get("git_sha")))
        return f"{when} (git {shas})"

    text = " and ".join(f"{name} recorded {seen(rs)}" for name, rs in labelled)
    span, one_code, one_run = run_verdict(rows)
    if span is None:
        verdict = "a recording time is missing, so it is unknown whether they come from one run"
    elif span > SAME_RUN_MINUTES:
        verdict = f"they are {span:.0f} minutes apart, so they come from different runs"
    elif not one_code:
        verdict = "they ran different code (commits or code hashes differ), so they come from different runs"
    else:
        verdict = f"they are {span:.0f} minutes apart running the same code, so they likely come from one run"
    return f"{text}: {verdict}."


def run_verdict(rows: list[dict]) -> tuple[float | None, bool, bool | None]:
    """Whether ``rows`` read as one run: the minutes between the first and the last recorded (None
    where a time is missing), whether they ran one code, and the verdict (None: unknown)."""
    times = [t for r in rows if (t := recorded_at(r)) is not None]
    span = (max(times) - min(times)).total_seconds() / 60 if times and len(times) == len(rows) else None
    one_code = len(code_ids(rows)) <= 1
    return span, one_code, None if span is None else (span <= SAME_RUN_MINUTES and one_code)


def steps_by_gpu(rows: list[dict]) -> dict[str, list[dict]]:
    steps = [r for r in rows if r.get("kind") == "step"]
    return {slug: [r for r in steps if (r.get("gpu_slug") or "unknown") == slug]
            for slug in sorted({r.get("gpu_slug") or "unknown" for r in steps})}




def split_runs(rows: list[dict]) -> list[list[dict]]:
    """The rows split into runs, oldest first: rows recorded within SAME_RUN_MINUTES of a run's
    first row, running the same code (env.code_sha, else the commit), belong to it. Rows without a
    recording time form one run of their own, first."""
    timed = sorted((r for r in rows if recorded_at(r) is not None), key=recorded_at)
    runs: list[list[dict]] = [[r for r in rows if recorded_at(r) is None]]
    for r in timed:
        cur = runs[-1]
        if (len(runs) > 1 and (recorded_at(r) - recorded_at(cur[0])).total_seconds() <= SAME_RUN_MINUTES * 60
                and code_ids(cur + [r]) == code_ids(cur)):
            cur.append(r)
        else:
            runs.append([r])
    return [run for run in runs if run]


def run_label(run: list[dict]) -> str:
    t = recorded_at(run[0]) if run else None
    return t.strftime("%m-%d %H:%M") if t else "unknown"
