"""harness.bench.memory on CUDA: the replayed peak accounts for the allocator's, and its sites
add up to it, for the user path with offloaded, chunked long-context switches."""

import json

import pytest

from harness import results as res
from harness.bench import memory as bench

pytestmark = pytest.mark.gpu


def test_the_replayed_peak_is_the_allocators_and_its_sites_add_up_to_it(tmp_path):
    bench.main(["--model", "qwen3-0.6b", "--seq-len", "8192", "--set", "recompute=all", "offload=double",
                "mlp_chunk=1024", "--top", "50", "--results", str(tmp_path)])
    path = next(tmp_path.rglob("*.jsonl"))
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["status"] == "ok" and row["kind"] == "memory_peak" and row["phase"] in bench.PHASES, row
    print(f"allocator {row['step_peak_gib']:.3f} GiB, replayed {row['replayed_peak_gib']:.3f} GiB, "
          f"{row['peak_kib_per_token']:.1f} KiB a token, {row['phase']}", flush=True)
    # the allocator's peak is the replay's, to what the history does not show: a large block's
    # unsplit remainder, or a block of the step's start freed before the peak
    assert row["replayed_peak_gib"] == pytest.approx(row["step_peak_gib"], rel=0.05, abs=0.05), row
    assert sum(g["gib"] for g in row["groups"]) == pytest.approx(row["replayed_peak_gib"], rel=1e-6)
    assert any(g["site"] != "(no frame)" for g in row["groups"])
    assert res.bench_key(row) != res.bench_key({**row, "settings": {}})
