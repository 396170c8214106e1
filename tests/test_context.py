"""harness.run.context: the longest trainable length per variant, searched over sweep points."""

import dataclasses
import json
import subprocess
import sys

import pytest

from harness import results as res
from harness import row as rowmod
from harness.run import context, experiment
from harness.run.context import next_length

EXP = """
[experiment]
name = "ctx"
description = "context search on CPU"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
batch_size = 1
warmup_steps = 3
measured_steps = 10
lora_rank = 4
dtype = "fp32"
device = "cpu"
baseline = "stock"
timeout_s = 300

[data]
distribution = "fixed"
median_doc_len = 1048576   # one document per row, whatever the length

[variants.stock]
role = "stock"

[variants.user]
role = "user"

[report.context]
targets = [{ model = "qwen3-0.6b-tiny", min_over_best_peer = 1.0, fits = 128 }]
"""


def test_next_length_doubles_until_a_failure_then_bisects_to_the_resolution():
    assert next_length([], [], 4096, 1 << 20, 1024) == 4096
    assert next_length([4096], [], 4096, 1 << 20, 1024) == 8192
    assert next_length([4096, 8192, 16384], [32768], 4096, 1 << 20, 1024) == 24576
    assert next_length([4096, 24576], [32768], 4096, 1 << 20, 1024) == 28672
    assert next_length([28672, 29696], [30720], 4096, 1 << 20, 1024) is None  # known to 1024 tokens
    assert next_length([1 << 20], [], 4096, 1 << 20, 1024) is None  # trains at the longest probed
    assert next_length([600000], [], 4096, 1 << 20, 1024) == 1 << 20  # the last doubling stops at max_len
    assert next_length([], [4096], 4096, 1 << 20, 1024) == 2048  # the first probe failed: halve
    assert next_length([], [1024], 4096, 1 << 20, 1024) is None  # below the resolution: nothing trains
    assert next_length([8192], [4096, 16384], 4096, 1 << 20, 1024) == 12288  # a failure below a success is noise
    # a start still open is probed first (--start on a search with rows): above what trained, below what failed
    assert next_length([65536], [], 131072, 1 << 20, 4096, predicted=353475) == 131072
    assert next_length([65536], [196608], 163840, 1 << 20, 4096) == 163840  # not the midpoint, 131072
    assert next_length([65536], [131072], 131072, 1 << 20, 4096) == 98304  # probed and failed: bisect
    assert next_length([65536], [], 32768, 1 << 20, 4096) == 131072  # below what trained: the search's own step
    assert next_length([28672], [29696], 29000, 1 << 20, 1024) is None  # the search is over: nothing more
    assert next_length([65536], [], 1 << 21, 1 << 20, 1024) == 131072  # past max_len: the search's own step
    assert next_length([65536], [69632], 67000, 1 << 20, 4096) is None  # no grid point left between: over


def test_two_peaks_predict_where_the_card_fills_and_the_search_goes_there():
    from harness.run.context import HEADROOM, predict

    # 10 GiB + 1 GiB per 1000 tokens on an 80 GiB card: full (at the headroom) near 66000 tokens
    peaks = {1000: 11.0, 2000: 12.0, 500: 10.5}
    assert predict(peaks, 80.0) == int(2000 + (HEADROOM * 80 - 12.0) / 0.001)
    assert predict({1000: 11.0}, 80.0) is None and predict(peaks, None) is None
    assert predict({1000: 11.0, 2000: 11.0}, 80.0) is None  # a peak that does not grow predicts nothing
    # past the longest that trained: there, rounded down, at most four times the length
    assert next_length([8192, 16384], [], 4096, 1 << 20, 1024, predicted=50000) == 49152
    assert next_length([1024, 2048], [], 1024, 1 << 20, 1024, predicted=50000) == 8192
    # within twice the length too: not a doubling past the line (262144 trained, full near 372800)
    assert next_length([8192, 16384], [], 4096, 1 << 20, 1024, predicted=30000) == 29696
    assert next_length([131072, 262144], [], 8192, 1 << 21, 16384, predicted=372800) == 360448
    assert next_length([2500, 5000], [], 2500, 1 << 20, 1024, predicted=5200) == 6024  # not 5120: a resolution up
    # at or below the length: a sixteenth up, then a failure bisects
    assert next_length([65536], [], 4096, 1 << 20, 1024, predicted=60000) == 65536 + 4096
    assert next_length([65536], [69632], 4096, 1 << 20, 1024, predicted=60000) == 67584  # a failure: bisect


class _Fake:
    """A sweep whose points train up to ``limit`` tokens and run out of memory beyond."""

    def __init__(self, limit, fail_at=None):
        self.limit, self.fail_at, self.rows, self.runs, self.code = limit, fail_at, [], [], "c"

    def run_point(self, exp):
        (point,) = exp.points()
        self.runs.append(point.seq_len)
        status = "error" if point.seq_len == self.fail_at else "ok" if point.seq_len <= self.limit else "oom"
        self.rows.append({**rowmod.identity(dataclasses.asdict(point)), "kind": "step", "status": status,
                          "message": "boom" if status == "error" else "", "env": {"code_id": self.code}})


def _probe_row(exp, model, variant, n, status, **extra):
    """A row of ``variant``'s probe at ``n`` tokens as ``exp`` defines the variant."""
    (point,) = [p for p in exp.points() if p.model == model and p.variant == variant][:1]
    return {**rowmod.identity(dataclasses.asdict(point)), "kind": "step", "seq_len": n, "status": status, **extra}


def _exp(tmp_path):
    path = tmp_path / "ctx.toml"
    path.write_text(EXP)
    return experiment.load(path)


def test_a_search_finds_the_longest_length_to_its_resolution_and_a_rerun_runs_nothing(tmp_path):
    exp, fake = _exp(tmp_path), _Fake(limit=23000)
    kw = dict(max_len=1 << 20, resolution=1024, run_point=fake.run_point, rows_of=lambda: fake.rows, code="c")
    s = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, **kw)
    assert 23000 - 1024 < s.longest <= 23000 and not s.stopped
    assert fake.runs[:10] == [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert len(fake.runs) == len(set(fake.runs)) == len(s.probes)
    again = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, **kw)
    assert again.probes == [] and again.longest == s.longest
    # told to keep another code's rows (code None: any code's), a search goes on from them
    fake.code = "d"
    kept = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, **{**kw, "code": None})
    assert kept.probes == [] and kept.longest == s.longest
    # else another code's rows do not count: that code's search starts over
    other = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, **{**kw, "code": "d"})
    assert other.probes[0][0] == 64


def test_probes_of_the_variant_as_the_file_defined_it_before_count_for_nothing(tmp_path):
    """An edited file (another LoRA rank) makes other points: their probes do not resume the search,
    as a sweep point of another identity resumes nothing; other probe settings do not matter."""
    exp, fake = _exp(tmp_path), _Fake(limit=23000)
    kw = dict(max_len=1 << 20, resolution=1024)
    s = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, run_point=fake.run_point, rows_of=lambda: fake.rows,
                       code="c", **kw)
    assert context.state(exp, "qwen3-0.6b-tiny", "user", fake.rows, "c", **kw) == (None, "")
    path = tmp_path / "rank8.toml"
    path.write_text(EXP.replace("lora_rank = 4", "lora_rank = 8"))
    rank8 = experiment.load(path)
    assert context.state(rank8, "qwen3-0.6b-tiny", "user", fake.rows, "c", **kw) == (64, "")
    assert context.left(rank8, fake.rows, "c", **kw)[:2] == [("qwen3-0.6b-tiny", "stock", None),
                                                              ("qwen3-0.6b-tiny", "user", None)]
    probes = dataclasses.replace(exp, warmup_steps=0, measured_steps=1)  # --probe-warmup 0 --probe-steps 1
    assert context.state(probes, "qwen3-0.6b-tiny", "user", fake.rows, "c", **kw) == (None, "")
    assert s.longest and context.search(probes, "qwen3-0.6b-tiny", "user", tmp_path, run_point=fake.run_point,
                                        rows_of=lambda: fake.rows, code="c", **kw).longest == s.longest


class _Limits(_Fake):
    """A sweep whose each variant trains up to its own limit."""

    def __init__(self, limits):
        super().__init__(limit=0)
        self.limits = limits

    def run_point(self, exp):
        (point,) = exp.points()
        self.limit = self.limits[point.variant]
        super().run_point(exp)


def test_ours_is_probed_at_the_best_peers_longest_once_the_peers_searches_finish(tmp_path):
    """Ours' search passes the peer's limit by (doubling, then bisecting its own bracket): a probe
    at the peer's longest length sets the two step times there side by side, once."""
    exp, fake = _exp(tmp_path), _Limits({"stock": 23000, "user": 70000})
    kw = dict(run_point=fake.run_point, rows_of=lambda: fake.rows, code="c")
    searches = [context.search(exp, "qwen3-0.6b-tiny", v, tmp_path, max_len=1 << 20, resolution=1024, **kw)
                for v in ("stock", "user")]
    peer, ours = searches
    assert not peer.stopped and peer.longest not in {n for n, _ in ours.probes}  # passed by
    before = len(fake.runs)
    context.meet(exp, searches, **kw)
    assert fake.runs[before:] == [peer.longest] and ours.probes[-1] == (peer.longest, "ok")
    context.meet(exp, searches, **kw)  # ours has its row there now
    assert len(fake.runs) == before + 1
    # a peer's search stopped short (out of time, a probe limit): its longest is not known yet
    short = [context.Search("qwen3-0.6b-tiny", "stock", longest=17000, stopped="stopped: out of time"), ours]
    context.meet(exp, short, **kw)
    assert len(fake.runs) == before + 1
    # one that ended on a refusal or an error above its longest is as far as it goes: ours meets it
    refused = context.Search("qwen3-0.6b-tiny", "stock", longest=17000,
                             stopped="the probe at 18000 tokens ended 'skipped': see its row")
    context.meet(exp, [refused, ours], **kw)
    assert fake.runs[before + 1:] == [17000] and ours.probes[-1] == (17000, "ok")
    # a meeting probe that failed (below ours' longest) does not end ours' search on a rerun
    fake.rows.append({**fake.rows[-1], "seq_len": 12000, "status": "error", "message": "boom"})
    rerun = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, max_len=1 << 20, resolution=1024, **kw)
    assert not rerun.stopped and rerun.probes == [] and rerun.longest == ours.longest
    before += 1
    # ours no longer than the peer, or the probe limit reached: nothing to meet
    context.meet(exp, [context.Search("qwen3-0.6b-tiny", "stock", longest=ours.longest + 1), ours], **kw)
    context.meet(exp, [context.Search("qwen3-0.6b-tiny", "stock", longest=1000), ours], max_probes=len(ours.probes),
                 **kw)
    assert len(fake.runs) == before + 1


class _PeakFake(_Fake):
    """Peaks of 10 GiB + 1 GiB per 1000 tokens on an 80 GiB card; out of memory past ``limit``."""

    def run_point(self, exp):
        super().run_point(exp)
        row = self.rows[-1]
        if row["status"] == "ok":
            row["peak_allocated_gib"] = 10 + row["seq_len"] / 1000
            row["env"]["memory_total_gib"] = 80.0


def test_a_search_with_peaks_jumps_to_where_the_card_fills_and_probes_less(tmp_path):
    exp = _exp(tmp_path)
    kw = dict(max_len=1 << 20, resolution=1024, code="c")
    with_peaks, doubling = _PeakFake(limit=68000), _PeakFake(limit=68000)
    s = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, run_point=with_peaks.run_point,
                       rows_of=lambda: with_peaks.rows, **kw)
    d = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, run_point=doubling.run_point,
                       rows_of=lambda: doubling.rows, use_peaks=False, **kw)
    assert s.longest == d.longest and 68000 - 1024 < s.longest <= 68000
    # from 128 tokens on, at most four times the length a probe, then the predicted 65536 and up
    assert with_peaks.runs[:8] == [64, 128, 512, 2048, 8192, 32768, 65536, 69632], with_peaks.runs
    assert len(with_peaks.runs) < len(doubling.runs) and max(with_peaks.runs) < max(doubling.runs) == 131072


def test_unsloths_search_goes_up_to_the_models_positions_and_no_further(tmp_path):
    """Past a model's positions Unsloth rescales RoPE (another model), so its probe there is refused:
    its search stops at the window, probing it, rather than jumping past it to a refusal that would
    end the search below the window. A refusal left above the window by an earlier search does not
    end it; llama3 RoPE, which Unsloth keeps, has no cap."""
    path = tmp_path / "ctx.toml"
    path.write_text(EXP + '\n[variants.unsloth]\nstack = "unsloth"\n')
    exp = experiment.load(path)
    window = 40960  # qwen3-0.6b-tiny's max_position_embeddings
    assert context.length_cap(exp, "qwen3-0.6b-tiny", "unsloth") == window
    assert context.length_cap(exp, "qwen3-0.6b-tiny", "user") is None
    assert context.length_cap(exp, "llama-3.1-8b-tiny", "unsloth") is None
    fake = _Fake(limit=1 << 20)
    fake.rows.append(_probe_row(exp, "qwen3-0.6b-tiny", "unsloth", 217088, "skipped", message="past the positions",
                                env={"code_id": "c"}))
    kw = dict(max_len=1 << 20, resolution=1024, run_point=fake.run_point, rows_of=lambda: fake.rows, code="c")
    s = context.search(exp, "qwen3-0.6b-tiny", "unsloth", tmp_path, **kw)
    assert s.longest == window and not s.stopped and max(fake.runs) == window, (s, fake.runs)
    assert context.state(exp, "qwen3-0.6b-tiny", "unsloth", fake.rows, "c", max_len=1 << 20,
                         resolution=1024) == (None, "")
    # the cap holds below a bound of its own: the command's --max-len, where it is shorter
    at64 = [_probe_row(exp, "qwen3-0.6b-tiny", "unsloth", 64, "ok", env={"code_id": "c"})]
    assert context.state(exp, "qwen3-0.6b-tiny", "unsloth", at64, "c", max_len=96, resolution=16)[0] == 96
    # a --start past the window starts at the window; a failure past it (a row from before the cap)
    # bounds nothing below it
    far = dataclasses.replace(exp, seq_lens=[65536])
    assert context.state(far, "qwen3-0.6b-tiny", "unsloth", [], "c", max_len=1 << 20, resolution=1024)[0] == window
    before = [_probe_row(exp, "qwen3-0.6b-tiny", "unsloth", n, st, env={"code_id": "c"})
              for n, st in ((32768, "ok"), (131072, "oom"))]
    assert context.state(exp, "qwen3-0.6b-tiny", "unsloth", before, "c", max_len=1 << 20, resolution=1024)[0] == window
    # another stack on the same model goes past the window, to where its memory ends
    fake.limit = 50000
    user = context.search(exp, "qwen3-0.6b-tiny", "user", tmp_path, **kw)
    assert user.longest > window


def test_a_variant_limited_to_some_models_has_no_search_for_the_others(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text(EXP.replace('models = ["qwen3-0.6b-tiny"]', 'models = ["qwen3-0.6b-tiny", "llama-3.2-1b-tiny"]')
                    .replace('[variants.user]\nrole = "user"', '[variants.user]\nrole = "user"\nmodels = ["qwen3-0.6b-tiny"]'))
    exp = experiment.load(path)
    assert context.pairs(exp) == [("qwen3-0.6b-tiny", "stock"), ("qwen3-0.6b-tiny", "user"),
                                  ("llama-3.2-1b-tiny", "stock")]
    left = context.left(exp, [], "c")
    assert ("llama-3.2-1b-tiny", "user", None) not in left and len(left) == 3, left


def test_an_error_ends_the_variants_search_and_says_where(tmp_path):
    exp, fake = _exp(tmp_path), _Fake(limit=1 << 20, fail_at=256)
    s = context.search(exp, "qwen3-0.6b-tiny", "stock", tmp_path, max_len=1 << 20, resolution=64,
                       run_point=fake.run_point, rows_of=lambda: fake.rows, code="c")
    assert s.longest == 128 and "256 tokens ended 'error'" in s.stopped and fake.runs == [64, 128, 256]


def test_a_timed_out_point_counts_as_not_training(tmp_path):
    rows = [{"model": "m", "variant": "v", "seq_len": 8192, "status": "error", "message": "timed out after 600 s"},
            {"model": "m", "variant": "v", "seq_len": 4096, "status": "ok"}]
    assert context.outcomes(rows, "m", "v", None) == {8192: "timeout", 4096: "ok"}


@pytest.mark.slow
def test_the_cli_searches_each_variant_with_real_points_and_writes_their_rows(tmp_path):
    """On CPU nothing runs out of memory: each variant trains at 64 and 128 tokens, the --max-len."""
    path = tmp_path / "ctx.toml"
    path.write_text(EXP)
    done = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--max-len", "128",
                           "--results", str(tmp_path / "results"), "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "qwen3-0.6b-tiny stock: longest trained 128 tokens" in done.stdout
    assert "qwen3-0.6b-tiny user: longest trained 128 tokens" in done.stdout
    rows = res.read_rows(res.results_path(tmp_path / "results", "ctx", "cpu"))
    assert sorted((r["variant"], r["seq_len"], r["status"]) for r in rows) == [
        ("stock", 64, "ok"), ("stock", 128, "ok"), ("user", 64, "ok"), ("user", 128, "ok")]
    # a peer that cannot run here ends its search on a refused probe: the command says so apart (4)
    refused = tmp_path / "refused.toml"
    refused.write_text(EXP.replace("[variants.user]\nrole = \"user\"", "[variants.unsloth]\nstack = \"unsloth\""))
    done4 = subprocess.run([sys.executable, "-m", "harness", "context", str(refused), "--max-len", "128",
                            "--variants", "unsloth", "--results", str(tmp_path / "results4"), "--quiet"],
                           capture_output=True, text=True)
    assert done4.returncode == context.ENDED_ON_A_FAILED_PROBE, (done4.stdout, done4.stderr[-2000:])
    assert "the probe at 64 tokens ended 'skipped'" in done4.stdout
    # the same rows as another code's: --keep-older-rows goes on from them, so nothing runs again
    path_rows = res.results_path(tmp_path / "results", "ctx", "cpu")
    path_rows.write_text("".join(json.dumps(r | {"env": r["env"] | {"code_id": "older"}}) + "\n" for r in rows))
    again = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--max-len", "128", "--keep-older-rows",
                            "--results", str(tmp_path / "results"), "--quiet"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("longest trained 128 tokens (probes this run: none run)") == 2, again.stdout
    assert all(set(r["num_docs"]) == {1} for r in rows)  # one document per row
    assert all(r["warmup_steps"] == 1 and r["measured_steps"] == 2 for r in rows)  # probes, not timings
    # the report reads the probes as the file's points (not stale), with the targets judged
    done = subprocess.run([sys.executable, "-m", "harness", "report", "ctx", "--results", str(tmp_path / "results"),
                           "--reports", str(tmp_path / "reports")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    text = (tmp_path / "reports" / "ctx" / "README.md").read_text()
    assert "## The longest trainable length per stack" in text and "stale rows" not in text
    assert "| qwen3-0.6b-tiny | user | user | 128 | none probed |" in text
    # both searches stopped at --max-len, with no probe above that failed: neither longest is known,
    # so the ratio is no verdict; a length ours trained at is one
    assert ("| ours' longest ≥ 1.0× the best peer's, qwen3-0.6b-tiny (cpu) | 1.00× (128 `user` vs 128 `stock`); "
            "ours and the peers' could go longer: no probe above ran out of memory; not searched: stock + torch.compile, "
            "Liger-Kernel, Unsloth | not yet known |") in text
    assert "| ours trains at 128 tokens, qwen3-0.6b-tiny (cpu) | longest 128 | yes |" in text


def test_the_cli_starts_where_it_is_told(tmp_path):
    # --start in place of the file's first length (64): the search begins at 96, then --max-len
    path = tmp_path / "ctx.toml"
    path.write_text(EXP)
    done = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--start", "96", "--max-len", "128",
                           "--variants", "user", "--results", str(tmp_path / "results"), "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "qwen3-0.6b-tiny user: longest trained 128 tokens (probes this run: 96 ok, 128 ok)" in done.stdout
    rows = res.read_rows(res.results_path(tmp_path / "results", "ctx", "cpu"))
    assert sorted((r["variant"], r["seq_len"]) for r in rows) == [("user", 96), ("user", 128)]
    # --probes 1 with --start: one probe at that length and no more, and exit 0 (a rerun goes on)
    one = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--start", "160", "--probes", "1",
                          "--variants", "user", "--results", str(tmp_path / "one"), "--quiet"],
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "longest trained 160 tokens (probes this run: 160 ok); stopped: 1 probe(s) run, the limit" in one.stdout
    assert [r["seq_len"] for r in res.read_rows(res.results_path(tmp_path / "one", "ctx", "cpu"))] == [160]
    bad = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--start", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--start" in bad.stderr
    # --probe-timeout in place of the file's 300 s: a probe past it is a timed-out row, which the
    # search reads as not training (its process alone takes longer than 0.5 s to start)
    quick = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--probe-timeout", "0.5",
                            "--variants", "user", "--results", str(tmp_path / "quick"), "--quiet"],
                           capture_output=True, text=True)
    assert quick.returncode == 0, quick.stderr[-2000:]
    assert "qwen3-0.6b-tiny user: longest trained - tokens (probes this run: 64 timeout)" in quick.stdout, quick.stdout
    (row,) = res.read_rows(res.results_path(tmp_path / "quick", "ctx", "cpu"))
    assert row["status"] == "error" and row["message"].startswith("timed out"), row
    for bad_s in ("0", "inf"):
        refused = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--probe-timeout", bad_s],
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and "--probe-timeout" in refused.stderr


def _row(variant, role, n, status, ms=None):
    return {"kind": "step", "gpu_slug": "g", "device_name": "G", "model": "m", "variant": variant, "role": role,
            "seq_len": n, "status": status, "step_ms": {"p50": ms} if ms else None, "message": ""}


def _short(*roles):
    """Peers bounded far below every length the test judges (ok at 1024, out of memory at 2048):
    searched, so no verdict waits on them, and never the best peer."""
    return [_row(f"short-{r}", r, n, st, 10.0 if st == "ok" else None) for r in roles for n, st in ((1024, "ok"), (2048, "oom"))]


def test_the_report_judges_ours_against_the_best_peer_at_its_longest_length(tmp_path):
    from harness.report import context as report

    rows = [_row("stock", "stock", 8192, "ok", 900.0), _row("stock", "stock", 16384, "oom"),
            _row("unsloth", "unsloth", 16384, "ok", 2000.0), _row("unsloth", "unsloth", 20480, "oom"),
            _row("compiled", "stock-compiled", 16384, "ok", 1800.0), _row("compiled", "stock-compiled", 20480, "oom"),
            _row("a-slow", "ours", 16384, "ok", 2500.0), _row("a-slow", "ours", 24576, "oom"),
            _row("abl", "ablation", 131072, "ok", 9000.0),
            _row("user", "user", 16384, "ok", 1500.0), _row("user", "user", 32768, "ok", 3500.0),
            _row("user", "user", 65536, "error", None) | {"message": "timed out after 600 s"}, *_short("peer")]
    text = report.lead(rows, rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5,
                                                 "faster_at_peer_longest": True, "fits": 65536}]}, out_dir=tmp_path)
    # the bar chart of the longest lengths, beside the table
    assert "![longest trained length per variant (g)](g-context-longest.png)" in text
    assert (tmp_path / "g-context-longest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| m | unsloth | unsloth | 16384 | 20480 (oom) |" in text
    assert "| m | user | user | 32768 | 65536 (timeout) |" in text
    # ours are the user and ours roles (not the ablation); of the peers tied at 16384, the fastest
    # the peers bracketed at 16384 to 20479: the ratio is the range that bracket allows
    assert ("| ours' longest ≥ 1.5× the best peer's, m (g) | 1.60× to 2.00× (32768 `user` vs 16384 to 20479 `compiled`); "
            "ours could go longer: no probe above ran out of memory (timed out, the point's time limit: `user` at 65536) | yes |") in text
    # of ours' rows at that length, the fastest (a-slow's 2500 ms is not it)
    assert "| ours faster than the best peer at its longest length, m (g) | 1500.0 vs 1800.0 ms at 16384 | yes |" in text
    # a probe past the point's time limit is the harness's limit, not the card's: 65536 is not yet known
    assert "| ours trains at 65536 tokens, m (g) | longest 32768 | not yet known |" in text


@pytest.mark.parametrize("peer, ours, verdict", [
    # the peer bracketed below 20480, ours at least 32768: 32768 >= 1.5 x 20479
    ([("ok", 16384), ("oom", 20480)], [("ok", 16384), ("ok", 32768)], "yes"),
    # the peer could reach 24575: 1.5 x that is more than the 32768 ours is known to reach
    ([("ok", 16384), ("oom", 24576)], [("ok", 16384), ("ok", 32768)], "not yet known"),
    # ours bracketed below 20480 against a peer of at least 16384: at most 1.25x
    ([("ok", 16384)], [("ok", 16384), ("oom", 20480)], "no"),
    # a peer stopped by a skipped probe (past the model's positions) is a lower bound, not its limit
    ([("ok", 16384), ("skipped", 32768)], [("ok", 16384), ("ok", 65536)], "not yet known"),
    # and so is one stopped by a probe past the point's time limit: not the card's limit
    ([("ok", 16384), ("timeout", 20480)], [("ok", 16384), ("ok", 32768)], "not yet known"),
    # ours timed out: bounded by no failure, ours is a lower bound that already reaches the goal
    ([("ok", 16384), ("oom", 20480)], [("ok", 16384), ("ok", 32768), ("timeout", 65536)], "yes"),
])
def test_a_verdict_on_the_longest_lengths_only_where_the_probes_settle_it(peer, ours, verdict):
    from harness.report import context as report

    def probe(variant, st, n):  # a point past its time limit is an error row that says so
        row = _row(variant, variant, n, "error" if st == "timeout" else st, 100.0 if st == "ok" else None)
        return row | ({"message": "timed out after 600 s"} if st == "timeout" else {})

    rows = [probe("unsloth", st, n) for st, n in peer] + [probe("user", st, n) for st, n in ours] \
        + _short("stock", "stock-compiled", "peer")
    text = report.lead(rows, rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5,
                                                 "faster_at_peer_longest": True}]})
    line = next(x for x in text.splitlines() if x.startswith("| ours' longest"))
    assert line.endswith(f"| {verdict} |"), line
    faster = next(x for x in text.splitlines() if x.startswith("| ours faster"))
    settled = any(st == "oom" for st, _ in peer)  # only a failed probe bounds the peer's longest
    assert faster.endswith("| no |" if settled else "| not yet known |"), faster  # 100 ms against 100 ms


def test_the_report_gives_the_offload_bound_of_a_profiled_probe_at_its_longest_length():
    from harness.report import context as report

    stats = {"host_buffer_bytes": 3 * 2**30, "reload_ms": [4.0, 5.0, 6.0, 5.0], "backward_ms": [90.0, 100.0, 110.0, 100.0]}
    long_row = _row("user-long", "ours", 65536, "ok", 2000.0) | {"offload_stats": stats}
    rows = [_row("user-long", "ours", 32768, "ok", 900.0) | {"offload_stats": stats | {"reload_ms": [1.0] * 4}},
            long_row, _row("user-long", "ours", 131072, "oom"), _row("stock", "stock", 8192, "ok", 500.0)]
    assert report.offload_bound(long_row) == {"n": 4, "c_ms": 5.0, "g_ms": 100.0, "bound_ms": 15.0}
    assert report.offload_bound(rows[-1]) is None  # not profiled: no bound, no row of that table
    text = report.lead(rows, rows, {})
    # at the longest length only: (4 - 1) * min(5, 100) = 15 ms, 0.8 % of the 2000 ms step
    assert "| m | user-long | 65536 | 3.00 | 4 | 5.00 | 100.0 | 15.0 | 2000.0 | 0.8 % |" in text
    assert "| m | stock | 8192 |" not in text


def test_a_peer_that_never_ran_bounds_nothing_and_a_skipped_probe_is_shown():
    """A peer refused at its first length (skipped) neither trains nor runs out: the verdicts stand
    on the peers that did. A skipped probe above a trained length is shown, but bounds nothing."""
    from harness.report import context as report

    rows = [_row("liger", "peer", 16384, "ok", 900.0), _row("liger", "peer", 20480, "oom"),
            _row("unsloth", "unsloth", 8192, "skipped"),
            _row("user", "user", 16384, "ok", 800.0), _row("user", "user", 32768, "ok", 2000.0),
            _row("user", "user", 65536, "oom"),
            _row("user-long", "ours", 16384, "ok", 1000.0), _row("user-long", "ours", 32768, "skipped"),
            *_short("stock", "stock-compiled")]
    text = report.lead(rows, rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5,
                                                 "faster_at_peer_longest": True, "fits": 131072}]})
    assert "| ours' longest ≥ 1.5× the best peer's, m (g) | 1.60× to 2.00× (32768 `user` vs 16384 to 20479 `liger`); " \
           "ours could go longer: no probe above ran out of memory | yes |" in text
    assert "| ours faster than the best peer at its longest length, m (g) | 800.0 vs 900.0 ms at 16384 | yes |" in text
    # user-long ended at a skipped probe: ours' longest is open-ended, so 131072 is not yet known
    assert "| ours trains at 131072 tokens, m (g) | longest 32768 | not yet known |" in text
    assert "| m | user-long | ours | 16384 | 32768 (skipped) |" in text


def test_a_peer_that_trained_at_the_models_positions_is_bounded_there():
    """Unsloth's search stops at the model's positions (131072 for gpt-oss-20b): trained there, it
    is as long as it goes, so ours past it settles the verdicts; short of it, it could go on."""
    from harness.report import context as report

    def row(variant, role, n, status, ms=None, **extra):
        return _row(variant, role, n, status, ms) | {"model": "gpt-oss-20b", **extra}

    ours = [row("user-long", "ours", 131072, "ok", 30000.0), row("user-long", "ours", 262144, "ok", 90000.0)]
    at_cap = [row("unsloth", "unsloth", 65536, "ok", 10000.0, stack="unsloth"),
              row("unsloth", "unsloth", 131072, "ok", 40000.0, stack="unsloth")]
    groups = report.by_variant(at_cap + ours)
    assert report.bounds(groups, [("g", "gpt-oss-20b", "unsloth")]) == (131072, 131072)
    assert report.bounds(groups, [("g", "gpt-oss-20b", "user-long")]) == (262144, float("inf"))
    short = report.by_variant(at_cap[:1])  # not yet at its limit: no bound
    assert report.bounds(short, [("g", "gpt-oss-20b", "unsloth")]) == (65536, float("inf"))
    rows = at_cap + ours + [row(f"short-{r}", r, n, st, 10.0 if st == "ok" else None)
                            for r in ("stock", "stock-compiled", "peer") for n, st in ((1024, "ok"), (2048, "oom"))]
    text = report.lead(rows, rows, {"targets": [{"model": "gpt-oss-20b", "min_over_best_peer": 1.5,
                                                 "faster_at_peer_longest": True}]})
    assert "| ours' longest ≥ 1.5× the best peer's, gpt-oss-20b (g) | 2.00× (262144 `user-long` vs 131072 `unsloth`)" \
           in text and "the peers' could go longer" not in text, text
    # what that ratio compares is said beside it, and in the table: Unsloth's limit, not a full card
    note = ("`unsloth` stops at the model's 131072 positions (its loader would rescale RoPE past them), not at a "
            "full card; ours trains past the model's context window, its RoPE as configured")
    assert note in text, text
    assert "| gpt-oss-20b | unsloth | unsloth | 131072 | none: its limit, the model's 131072 positions |" in text, text
    # short of its limit, or ours no longer than it: no such note
    for part in (at_cap[:1] + ours, at_cap + ours[:1]):
        g = report.by_variant(part)
        assert report.window_note(g, [("g", "gpt-oss-20b", "unsloth")], [("g", "gpt-oss-20b", "user-long")]) == ""
    # another peer trained past the limit: the ratio is against a full card, so no note either
    longer = [row("stock", "stock", 196608, "ok", 1.0)]
    g = report.by_variant(at_cap + ours + longer)
    keys = [("g", "gpt-oss-20b", "unsloth"), ("g", "gpt-oss-20b", "stock")]
    assert report.window_note(g, keys, [("g", "gpt-oss-20b", "user-long")]) == ""
    assert report.window_note(g, keys[:1], [("g", "gpt-oss-20b", "user-long")]) == note
    # an older out-of-memory row past the limit moves neither the bound nor the cell
    stale = at_cap + ours + [row("unsloth", "unsloth", 262144, "oom", stack="unsloth")]
    g = report.by_variant(stale)
    assert report.bounds(g, [("g", "gpt-oss-20b", "unsloth")]) == (131072, 131072)
    stale_text = report.lead(stale, stale, {})
    assert "| gpt-oss-20b | unsloth | unsloth | 131072 | none: its limit, the model's 131072 positions |" in stale_text
    assert "| ours faster than the best peer at its longest length, gpt-oss-20b (g) | 30000.0 vs 40000.0 ms at 131072 | yes |" \
           in text, text


def test_ours_out_of_memory_at_its_first_length_does_not_fit():
    from harness.report import context as report

    rows = [_row("user", "user", 8192, "oom"), _row("stock", "stock", 8192, "ok", 500.0)]
    text = report.lead(rows, rows, {"targets": [{"model": "m", "fits": 16384}]})
    assert "| ours trains at 16384 tokens, m (g) | trained at no length probed | no |" in text


def test_a_step_timed_without_a_warm_up_judges_no_speed():
    """A probe of ``--probe-warmup 0`` times its first step, compiling included: at the best peer's
    longest length, such a row of ours or the peer's leaves the speed target not yet known, and says
    why; the same rows with a warm-up step are judged."""
    from harness.report import context as report

    def rows(warmup):
        return [_row("unsloth", "unsloth", 16384, "ok", 2000.0) | {"warmup_steps": 1},
                _row("unsloth", "unsloth", 20480, "oom"),
                _row("user-long", "ours", 16384, "ok", 2600.0) | {"warmup_steps": warmup},
                _row("user-long", "ours", 32768, "ok", 9000.0) | {"warmup_steps": warmup},
                *_short("stock", "stock-compiled", "peer")]

    spec = {"targets": [{"model": "m", "faster_at_peer_longest": True}]}
    cold = report.lead(rows(0), rows(0), spec)
    assert ("| ours faster than the best peer at its longest length, m (g) | 2600.0 vs 2000.0 ms at 16384; timed "
            "without a warm-up step (the first step, compiling included): `user-long` | not yet known |") in cold
    warm = report.lead(rows(1), rows(1), spec)
    assert "| ours faster than the best peer at its longest length, m (g) | 2600.0 vs 2000.0 ms at 16384 | no |" in warm


def test_an_oom_bounds_past_a_timeout_below_it_and_a_peer_that_only_timed_out_bounds_nothing():
    """Ours trained 16384, ran out of memory at 32768 (doubling), and the bisection's 24576 timed
    out: the out-of-memory probe still bounds ours below 32768. A peer whose only probe timed out,
    at its first length, is not a peer that never ran: its longest is unknown, so no verdict
    stands on the other peer alone."""
    from harness.report import context as report

    def timed_out(variant, role, n):
        return _row(variant, role, n, "error") | {"message": "timed out after 600 s"}

    ours = [_row("user", "user", 16384, "ok", 1000.0), _row("user", "user", 32768, "oom"),
            timed_out("user", "user", 24576)]
    peer = [_row("unsloth", "unsloth", 16384, "ok", 900.0), _row("unsloth", "unsloth", 20480, "oom"),
            *_short("stock", "stock-compiled", "peer")]
    spec = {"targets": [{"model": "m", "min_over_best_peer": 2.0, "fits": 32768}]}
    text = report.lead(ours + peer, ours + peer, spec)
    assert "| ours trains at 32768 tokens, m (g) | longest 16384 | no |" in text
    assert text.count("could go longer") == 0 and "| ours' longest ≥ 2.0× the best peer's, m (g) | 0.80× to 1.00× " in text
    assert next(x for x in text.splitlines() if x.startswith("| ours' longest")).endswith("| no |")
    # a second peer, timed out at its first length: the peers' longest is no longer bounded
    slow = [timed_out("liger", "peer", 16384)]
    ours_long = [_row("user", "user", 16384, "ok", 1000.0), _row("user", "user", 65536, "ok", 9000.0)]
    rows = ours_long + peer + slow
    text = report.lead(rows, rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]})
    line = next(x for x in text.splitlines() if x.startswith("| ours' longest"))
    assert line.endswith("| not yet known |") and "`liger` at 16384" in line, line
    assert report.lead(ours_long + peer, ours_long + peer, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]}) \
        .count("| yes |") == 1  # without it, the verdict stands


def test_the_blog_section_gives_each_stacks_longest_and_the_headline_what_the_probes_bound():
    from harness.report.blog import context as blog

    rows = [_row("unsloth", "unsloth", 16384, "ok", 900.0), _row("unsloth", "unsloth", 20480, "oom"),
            _row("user-long", "ours", 32768, "ok", 2000.0) | {"offload_stats": {"host_buffer_bytes": 3 * 2**30},
                                                              "switches": {"recompute": "all", "mlp_chunk": 4096,
                                                                           "attn_implementation": "sdpa"}},
            _row("user-long", "ours", 65536, "oom"), _row("stock", "stock", 8192, "ok", 500.0),
            _row("stock", "stock", 16384, "oom"), {**_row("x", "unsloth", 1, "ok"), "kind": "memory_peak"}]
    text, head = blog.part(rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]}, None)
    assert text.startswith("## 4. Long context on one GPU") and "### G" in text
    assert "| m | `user-long` | ours | 32768 | 65536 (oom) | – | 3.00 |" in text
    assert "| m | `stock` | stock | 8192 | 16384 (oom) |" in text and "`x`" not in text  # step rows only
    # a peer role with no probe is named: the best peer may be one not searched
    assert head.measured == {"G": "m: ours 32768 tokens vs the best peer's 16384 to 20479 (1.60× to 2.00×); not searched: "
                                  "stock + torch.compile, Liger-Kernel"}
    assert "Targets: met or not" in text
    assert "Ours, as each row ran it: `user-long` (m): `optim.enable(model, mlp_chunk=4096, recompute='all')`." in text
    assert "[reports/context](context/README.md)" in text and "judged under \"Targets: met or not\", `context`." in text
    # a search still open on either side is said to be
    rows.pop(1)
    assert "; the peers' not yet bounded; not searched:" in blog.part(rows, {}, None)[1].measured["G"]
    assert blog.part([], {}, None)[0] == ""


def test_the_blog_section_reads_a_second_experiment_its_models_ranks_and_a_peer_bounded_only_far_above():
    """gpt-oss-20b's search (r=64, experiment context-moe) beside the dense models' (r=16): the text
    names each model's rank and both experiments; a peer that trained at 16384 and ran out of memory
    at 65536 has a longest somewhere between, and the headline says so instead of a bare ratio."""
    from harness.report.blog import context as blog

    dense = [_row("unsloth", "unsloth", 16384, "ok", 900.0) | {"lora_rank": 16, "experiment": "context"},
             _row("unsloth", "unsloth", 17408, "oom") | {"lora_rank": 16, "experiment": "context"},
             _row("user-long", "ours", 32768, "ok", 2000.0) | {"lora_rank": 16, "experiment": "context",
                                                                "switches": {"recompute": "all", "mlp_chunk": 4096}}]
    moe = [r | {"model": "oss", "lora_rank": 64, "experiment": "context-moe"}
           for r in (_row("stock", "stock", 16384, "ok", 2352.0), _row("stock", "stock", 65536, "oom"),
                     _row("user-long", "ours", 65536, "ok", 9146.0) | {"switches": {"recompute": "all"}})]
    text, head = blog.part(dense + moe, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]}, None)
    assert "bf16 LoRA, r=16 for m, r=64 for oss)" in text
    assert "[reports/context](context/README.md), [reports/context-moe](context-moe/README.md)." in text
    assert "judged under \"Targets: met or not\", `context` and `context-moe`." in text
    assert ("`user-long` (m): `optim.enable(model, mlp_chunk=4096, recompute='all')`; "
            "`user-long` (oss): `optim.enable(model, recompute='all')`") in text
    claims = head.measured["G"].split("; oss: ")
    # 16384 to 17407: even a bracket bisected to 1024 tokens moves the ratio, so it is a range
    assert claims[0].startswith("m: ours 32768 tokens vs the best peer's 16384 to 17407 (1.88× to 2.00×)"), claims[0]
    # 16384 to 65535: the ratio is a range, from the peer's upper bound to its longest trained
    assert claims[1].startswith("ours 65536 tokens vs the best peer's 16384 to 65535 (1.00× to 4.00×); "
                                "ours not yet bounded"), claims[1]
    # 16384 to 24575: a range too
    mid = [r | {"model": "mid"} for r in (_row("stock", "stock", 16384, "ok", 1.0), _row("stock", "stock", 24576, "oom"),
                                         _row("user-long", "ours", 32768, "ok", 2.0))]
    assert "the best peer's 16384 to 24575 (1.33× to 2.00×)" in blog.part(mid, {}, None)[1].measured["G"]
    # a bracket closed to the token: one length, one ratio
    tight = [r | {"model": "tight"} for r in (_row("stock", "stock", 16384, "ok", 1.0), _row("stock", "stock", 16385, "oom"),
                                             _row("user-long", "ours", 32768, "ok", 2.0))]
    assert "ours 32768 tokens vs the best peer's 16384 (2.00×)" in blog.part(tight, {}, None)[1].measured["G"]
    ranks = [_row("p", "stock", 1024, "ok", 1.0) | {"model": f"r{r}", "lora_rank": r} for r in (128, 16, 64)]
    assert "bf16 LoRA, r=16 for r16, r=64 for r64, r=128 for r128)" in blog.part(ranks, {}, None)[0]  # by number


def test_a_peer_role_never_searched_withholds_a_met_verdict_and_is_named():
    """Ours at twice Unsloth's longest is no verdict while stock, stock + compile and Liger-Kernel
    were never probed: one of them could train longer. A miss stands: another peer can only raise
    the best peer's length."""
    from harness.report import context as report

    spec = {"targets": [{"model": "m", "min_over_best_peer": 1.5, "faster_at_peer_longest": True}]}
    peer = [_row("unsloth", "unsloth", 16384, "ok", 900.0), _row("unsloth", "unsloth", 20480, "oom")]

    def verdicts(rows):
        text = report.lead(rows, rows, spec)
        return [x for x in text.splitlines() if x.startswith(("| ours' longest", "| ours faster"))]

    long_ours = [_row("user", "user", 16384, "ok", 800.0), _row("user", "user", 65536, "ok", 5000.0)]
    longest, faster = verdicts(peer + long_ours)
    assert longest.endswith("; not searched: stock transformers + peft, stock + torch.compile, Liger-Kernel "
                            "| not yet known |"), longest
    assert faster.endswith("| not yet known |") and "not searched" in faster, faster
    assert [v.rsplit("|", 2)[1].strip() for v in verdicts(peer + long_ours + _short("stock", "stock-compiled", "peer"))] \
        == ["yes", "yes"]
    short_ours = [_row("user", "user", 16384, "ok", 800.0), _row("user", "user", 20480, "oom")]
    assert verdicts(peer + short_ours)[0].endswith("| no |")


def test_an_unbounded_longest_is_projected_from_two_peaks_and_says_what_offload_would_hold():
    from harness.report import context as report
    from harness.run.context import HEADROOM

    env = {"code_id": "c", "memory_total_gib": 80.0, "host_memory_gib": 125.0}
    stats = {"host_buffer_bytes": 30 * 2**30}  # 30 GiB of checkpoints at 131072 tokens

    def ok(variant, role, n, peak, **extra):
        return _row(variant, role, n, "ok", 1000.0) | {"peak_allocated_gib": peak, "env": env, **extra}

    rows = [ok("user-long", "ours", 65536, 25.0, offload_stats=stats | {"host_buffer_bytes": 15 * 2**30}),
            ok("user-long", "ours", 131072, 35.0, offload_stats=stats),
            ok("unsloth", "unsloth", 65536, 27.0), ok("unsloth", "unsloth", 131072, 38.0),
            _row("unsloth", "unsloth", 262144, "oom")]
    # 10 GiB per 65536 tokens from 35 GiB at 131072: 95 % of 80 GiB at 131072 + (76 - 35) / 10 * 65536
    n = int(131072 + (HEADROOM * 80.0 - 35.0) / (10.0 / 65536))
    assert report.projected(rows[:2], rows[1]) == n
    assert report.projected(rows[2:], rows[3]) is None  # bounded: its out-of-memory probe says where
    assert report.projected(rows[:1], rows[0]) is None  # one peak draws no line
    # a probe above that was refused (Unsloth past the model's positions): no line goes past it
    refused = [*rows[2:4], _row("unsloth", "unsloth", 217088, "skipped")]
    assert report.projected(refused, refused[1]) is None
    # nor past the model's positions, where Unsloth's search stops (gpt-oss-20b: 131072), nor from there
    capped = [{**r, "model": "gpt-oss-20b", "stack": "unsloth"} for r in rows[2:4]]
    assert report.projected(capped[:1] + [{**capped[0], "seq_len": 98304, "peak_allocated_gib": 30.0}],
                            capped[0] | {"seq_len": 98304}) is None
    assert report.projected(capped, capped[1]) is None
    uncapped = [{**r, "model": "gpt-oss-20b"} for r in rows[:2]]  # ours: no stack limit
    assert report.projected(uncapped, uncapped[1]) == n
    # a stack that keeps what memory allows is near the card at every length: no line extends it
    full = [ok("user", "user", 65536, 67.6), ok("user", "user", 131072, 71.6)]
    assert report.projected(full, full[1]) is None
    text = report.lead(rows, rows, {})
    assert f"| m | user-long | ours | 131072 | none probed | {n:,} (projected) |" in text
    assert "| m | unsloth | unsloth | 131072 | 262144 (oom) | – |" in text
    assert "| 30.00 of 125.0 |" in text  # what the checkpoints held, of the host's memory
    # at the projected length the checkpoints grow with it: 30 GiB x n / 131072
    assert f"`user-long` (m) {30 * n / 131072:.1f} GiB at {n:,} tokens, of the host's 125.0 GiB" in text


def test_a_probe_the_host_ran_out_of_memory_for_bounds_the_search_and_says_so():
    """A peer whose probe the kernel's OOM killer ended (memory_bound host) is bounded there as by a
    GPU OOM: no projection past it, the verdict uses it, and the table says the host ran out and
    how full it got; each longest probe shows the host's memory in use at its peak."""
    from harness.report import context as report

    env = {"code_id": "c", "memory_total_gib": 80.0, "host_memory_gib": 125.9}

    def ok(variant, role, n, peak, host_used):
        return _row(variant, role, n, "ok", 1000.0) | {"peak_allocated_gib": peak, "env": env,
                                                        "host_used_peak_gib": host_used}

    killed = _row("unsloth", "unsloth", 294912, "oom") | {"memory_bound": "host", "host_used_peak_gib": 124.8,
                                                          "env": env}
    rows = [ok("unsloth", "unsloth", 131072, 38.0, 60.2), ok("unsloth", "unsloth", 262144, 57.5, 110.4), killed,
            ok("user-long", "ours", 262144, 55.3, 70.0), ok("user-long", "ours", 458752, 75.0, 112.3),
            _row("user-long", "ours", 524288, "oom"), *_short("stock", "stock-compiled", "peer")]
    text = report.lead(rows, rows, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]})
    assert "| m | unsloth | unsloth | 262144 | 294912 (oom, host: sampled peak 124.8 of 125.9 GiB in use) | – |" in text
    assert "| 57.50 | – | 110.4 |" in text and "| 75.00 | – | 112.3 |" in text
    # the peer bracketed at 262144 to 294911: 458752 / 294911 = 1.55 at least, 1.75 over its longest trained: met
    assert ("| ours' longest ≥ 1.5× the best peer's, m (g) | 1.55× to 1.75× (458752 `user-long` vs 262144 to 294911 "
            "`unsloth`) | yes |") \
        in text
    # the same peer killed by SIGKILL without the killer's word is an error: it bounds nothing
    unsure = [r for r in rows if r is not killed] + [
        _row("unsloth", "unsloth", 294912, "error") | {"message": "killed by SIGKILL (host out of memory?)"}]
    text = report.lead(unsure, unsure, {"targets": [{"model": "m", "min_over_best_peer": 1.5}]})
    assert "| m | unsloth | unsloth | 262144 | 294912 (error) | – |" in text  # nor projected past the death
    assert ("the peers' could go longer: no probe above ran out of memory (a probe above died, which bounds "
            "nothing: `unsloth` at 294912: killed by SIGKILL (host out of memory?))") in text
    assert "| not yet known |" in text


def test_a_context_experiment_of_several_gpu_counts_is_refused(tmp_path):
    """A search matches each probe's row by the point's identity, one GPU count's: a file of two
    counts gets one clear error, before any probe runs."""
    path = tmp_path / "ctx.toml"
    path.write_text(EXP.replace("[experiment]\n", "[experiment]\ngpus = [1, 2]\nparallel = \"fsdp2\"\n", 1))
    out = subprocess.run([sys.executable, "-m", "harness", "context", str(path), "--results", str(tmp_path / "r"),
                          "--quiet"], capture_output=True, text=True)
    assert out.returncode == 2 and "experiment.gpus is [1, 2]" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "r").exists()
