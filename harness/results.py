"""Result rows: one JSON object per line under ``results/<experiment>/<gpu_slug>.jsonl``.

Writes are atomic: the whole file is rewritten to a temporary sibling, fsynced and renamed over
the old one under an exclusive lock, so a sweep killed at any instant leaves either the old file
or the new one, never a torn line. Reports and gates read only these files.

Row schema (``schema`` = 1). Every row has:
    schema, kind ("step" | "bandwidth"), experiment, gpu_slug, device_name, status
    (``harness.row.STATUSES``), message (str, empty when ok), env (dict, see harness.measure.env), recorded_at (ISO-8601 UTC).
A ``step`` row (one sweep point) is ``harness.row.Row``: its identity, context and outcome, and
    when ok what it measured (``harness.row.MEASURED``). docs/harness.md lists every field, from
    ``harness.row.schema_markdown``.
A microbenchmark row (``python -m harness.bench.offload|moe|packing``) has a kind in
``harness.measured``'s bench kinds and the fields its benchmark measures (see each bench module); it also records
``command``, ``env``, ``gpu_slug``, ``device_name`` and ``recorded_at``. A rerun replaces the rows
with the same ``bench_key``.
A ``bandwidth`` row adds:
    direction ("h2d"), memory ("pinned" | "pageable"), size_bytes, gbps {"p20","p50","p80","samples"},
    pcie_ceiling_gbps (None if unknown), pcie_gen, pcie_width.
A ``stopped`` row (``harness.run.sweep.stopped_row``) says a sweep was stopped while one of its
points ran: point_id, model, seq_len, variant, wall_s (how long the point had run) and message. No
table, gate or resume reads it as a result; ``point_wall_s`` does, and the point's next finished row
replaces it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from harness import measured
from harness.errors import InputError

SCHEMA_VERSION = 1
FINISHED = ("ok", "oom")  # an error is retried on resume; an OOM would only OOM again


def is_finished(row: dict) -> bool:
    """A step row a resume keeps (``FINISHED``), but for the OOM of the host's memory
    (``memory_bound`` host): what else the host held then counted, so the point runs again."""
    return (row.get("kind") == "step" and row.get("status") in FINISHED
            and not (row.get("status") == "oom" and row.get("memory_bound") == "host"))
# What one microbenchmark row measured: a rerun of the same replaces it.
BENCH_KEY = ("kind", "model", "seq_len", "doc_len", "tokens", "batch_size", "backend", "mode", "lora",
             "from_position_ids", "window", "sinks", "with_metadata", "device_type",
             "corpus", "adapter_seed",  # convergence: another corpus, order or seed is another measurement
             "stack", "settings", "lora_rank",  # memory: another stack, set of switches or rank is another measurement
             "loss_mode", "dtype", "attn",  # offload: the full loss's rows beside the chunked one's, not over them
             "attn_implementation", "experts_implementation",  # trainer: which stock attention and experts ran
             "logging_steps", "trainer_args")  # trainer: a log every step syncs the host every step


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def gpu_slug(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3``; ``cpu`` stays ``cpu``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug or "unknown"


def results_path(root: str | Path, experiment: str, slug: str) -> Path:
    return Path(root) / experiment / f"{slug}.jsonl"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_rows(path: str | Path) -> list[dict]:
    """All complete rows of one file. A line that is not valid JSON is reported, never dropped silently."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text at byte {e.start} ({e.reason}); the file is corrupt and was left "
                         "as it is: fix or remove the damaged line") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not a whole result row ({e.msg}); the file is truncated or "
                             "corrupt and was left as it is: fix or remove that line") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{lineno}: a result row is a JSON object, this line holds a "
                             f"{type(row).__name__}; the file was left as it is: fix or remove that line")
        rows.append(row)
    return rows


def check_writable(folder: str | Path) -> None:
    """Refuse, before anything runs, a results folder this process cannot write."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check."):
            pass
    except OSError as e:
        raise InputError(f"{folder}: cannot write results there ({e.strerror}); nothing was run") from None


def _file_mode() -> int:
    """What a file made with open() gets: 0666 less the umask (mkstemp alone would give 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_atomic(path: Path, rows: Iterable[dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, _file_mode())
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True, default=_json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def append_row(path: str | Path, row: dict, *, replace_point: bool = False) -> None:
    """Append ``row`` atomically. With ``replace_point`` the older rows of the same point_id go."""
    path = Path(path)
    row = {"schema": SCHEMA_VERSION, **row}
    with _locked(path):
        rows = read_rows(path)
        if replace_point and row.get("point_id"):
            rows = [r for r in rows if r.get("point_id") != row["point_id"]]
        rows.append(row)
        _write_atomic(path, rows)


def replace_rows(path: str | Path, drop, new_rows: list[dict]) -> None:
    """Atomically drop the rows for which ``drop(row)`` is true and append ``new_rows``."""
    path = Path(path)
    with _locked(path):
        rows = [r for r in read_rows(path) if not drop(r)]
        rows += [{"schema": SCHEMA_VERSION, **r} for r in new_rows]
        _write_atomic(path, rows)


def finished_point_ids(path: str | Path, code_id: str | None = None) -> set[str]:
    """The points a step row finished (``is_finished``: ok, or out of the GPU's memory); with
    ``code_id``, only rows that code measured (``env.code_id``, ``harness.measure.env.code_id``)."""
    return {r["point_id"] for r in read_rows(path) if is_finished(r)
            and r.get("point_id") and (code_id is None or (r.get("env") or {}).get("code_id") == code_id)}


def point_wall_s(rows: list[dict]) -> dict[str, float]:
    """point id -> the longest wall time (process start to row) its rows recorded, whatever their
    status, and the time it had run where a sweep stopped while it ran (kind "stopped"): what the
    next run of that point on the same GPU type should be expected to take."""
    out: dict[str, float] = {}
    for r in rows:
        if r.get("kind") in ("step", "stopped") and r.get("point_id") and isinstance(w := r.get("wall_s"), (int, float)):
            out[r["point_id"]] = max(out.get(r["point_id"], 0.0), float(w))
    return out


# a point timed on another GPU type only: that one may be the faster, so allow half as long again
ELSEWHERE_FACTOR = 1.5


def point_estimate_s(history: dict[str, float], point_id: str, default: float | None,
                     elsewhere: dict[str, float] | None = None) -> float | None:
    """How long to expect a point to take: its longest recorded wall time on this GPU type with a
    10 % + 5 s margin; else its longest on another GPU type (``elsewhere``) times ELSEWHERE_FACTOR
    + 5 s, but no more than ``default`` (the longest any point of its kind takes); else ``default``
    (None: unknown)."""
    if point_id in history:
        return history[point_id] * 1.1 + 5
    if elsewhere and point_id in elsewhere:
        guess = elsewhere[point_id] * ELSEWHERE_FACTOR + 5
        return guess if default is None else min(guess, default)
    return default


def wall_history(root: str | Path, experiment: str, slug: str) -> tuple[dict[str, float], dict[str, float]]:
    """(point id -> longest wall time on ``slug``, the same over every other GPU type's rows) of one
    experiment: what ``point_estimate_s`` takes."""
    here = results_path(root, experiment, slug)
    others = [r for path in sorted((Path(root) / experiment).glob("*.jsonl")) if path != here
              for r in read_rows(path)]
    return point_wall_s(read_rows(here)), point_wall_s(others)


def load_experiment_rows(root: str | Path, experiment: str) -> list[dict]:
    """Every row of every GPU type for one experiment."""
    rows = []
    for path in sorted((Path(root) / experiment).glob("*.jsonl")):
        rows.extend(read_rows(path))
    return rows


def bench_key(row: dict) -> str:
    return json.dumps([row.get(k) for k in BENCH_KEY], default=str)


def write_bench_rows(root: str | Path, experiment: str, rows: list[dict], *, env: dict, command: str) -> Path:
    """Store a microbenchmark's rows beside the sweep rows of ``experiment`` on this GPU type,
    replacing earlier rows with the same ``bench_key``; a row that did not run ``ok`` (an OOM, a
    crash) replaces only earlier failures, never a measurement, which stays beside it."""
    device_name = env.get("device_name") or "cpu"
    slug = gpu_slug(device_name)
    stamp = {"experiment": experiment, "gpu_slug": slug, "device_name": device_name, "env": env,
             "command": command, "recorded_at": now()}
    new = [{**r, **stamp} for r in rows]
    for r in new:
        if r.get("kind") not in (kinds := measured.bench_kinds()):
            raise ValueError(f"not a microbenchmark row kind: {r.get('kind')!r} (valid: {sorted(kinds)})")
    ok_keys = {bench_key(r) for r in new if r.get("status", "ok") == "ok"}
    failed_keys = {bench_key(r) for r in new} - ok_keys
    path = results_path(root, experiment, slug)

    def replaced(r: dict) -> bool:
        if r.get("kind") not in kinds:
            return False
        key = bench_key(r)
        return key in ok_keys or (key in failed_keys and r.get("status", "ok") != "ok")

    replace_rows(path, replaced, new)
    return path
