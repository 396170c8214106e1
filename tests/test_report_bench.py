"""Bench outputs under results/<name>-bench/ render into reports/<name>/README.md; these tests
write small bench files to tmp_path (never the real results/) and check what a reader would see."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness import report, report_bench

FIXTURE_RESULTS = Path(__file__).parent / "fixtures" / "results"
H100 = "nvidia-h100-80gb-hbm3"
ENV = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "git_sha": "0123456789abcdef"}
MIB, GIB = 2**20, 2**30


def _cells(text: str, prefix: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith(prefix))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    level = heading.split(" ")[0]
    rest = text[start + len(heading):]
    ends = [rest.find("\n" + "#" * n + " ") for n in range(1, len(level) + 1)]
    ends = [e for e in ends if e >= 0]
    return heading + (rest[: min(ends)] if ends else rest)


def _offload_point(model, seq_len, batch, layer_bytes, p50, peaks, summary) -> list[dict]:
    base = {"model": model, "seq_len": seq_len, "batch_size": batch, "layer_input_bytes": layer_bytes,
            "num_layers": 36, "warmup_steps": 1, "measured_steps": 3}
    rows = [{**base, "kind": "offload", "mode": mode, "status": "ok",
             "step_ms": {"p20": ms - 1, "p50": ms, "p80": ms + 2, "samples": [ms]},
             "peak_allocated_gib": peaks[mode]} for mode, ms in p50.items()]
    return rows + [{**base, "kind": "offload_summary", **summary}]


def _offload_rows() -> list[dict]:
    # qwen3-8b: c=20, g=30, n=33 → (n−1)·min(c,g) = 640 ms; single 2000 → double 1800 saves 200 ms.
    eight = _offload_point(
        "qwen3-8b", 2048, 4, 64 * MIB,
        {"none": 1750.0, "single": 2000.0, "double": 1800.0, "save_on_cpu": 2100.0},
        {"none": 30.0, "single": 24.9375, "double": 25.0, "save_on_cpu": 25.5},
        {"layers_reloaded": 33, "c_ms": 20.0, "g_ms": 30.0, "c_pred_ms": 19.5, "pinned_gbps": 3.44,
         "predicted_double_over_single_pct": 47.06, "second_buffer_gib": 0.0625,
         "second_buffer_peak_gib": 0.0625 + MIB / GIB,  # within the allocator's 2 MiB rounding
         "trace": {"overlap_pct": 97.5, "h2d_pinned": 32, "h2d_count": 32}})
    # qwen3-14b: c=2, g=100, n=39 → 76 ms can be hidden of a 5000 ms step: bound +1.5% < +6.7%.
    fourteen = _offload_point(
        "qwen3-14b", 8192, 1, 80 * MIB,
        {"none": 4500.0, "single": 5000.0, "double": 4950.0, "save_on_cpu": 4900.0},
        {"none": 40.0, "single": 30.0, "double": 30.2, "save_on_cpu": 31.0},
        {"layers_reloaded": 39, "c_ms": 2.0, "g_ms": 100.0, "second_buffer_gib": 80 * MIB / GIB,
         "second_buffer_peak_gib": 0.2, "trace": None})
    # A model the seeds give no figure for, with a summary missing every field.
    small = _offload_point("llama-3.2-1b", 1024, 2, None, {"double": 90.0}, {"double": None}, {})
    oom = [{"kind": "offload", "model": "qwen3-32b", "seq_len": 8192, "batch_size": 2, "mode": "build",
            "status": "oom", "message": "CUDA out of memory.\nTried to allocate 2 GiB"}]
    return eight + fourteen + small + oom


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


@pytest.fixture
def offload_readme(tmp_path) -> str:
    _write(tmp_path / "results" / "offload-bench" / f"{H100}.bench.json",
           {"env": ENV, "device": "cuda", "rows": _offload_rows()})
    return report.build_report(tmp_path / "results", "offload", tmp_path / "reports").read_text()


def test_offload_step_and_overlap_tables(offload_readme):
    side = _section(offload_readme, "## Side-by-side benchmark (one process)")
    assert "### NVIDIA H100 80GB HBM3 (`nvidia-h100-80gb-hbm3`)" in side
    assert "`results/offload-bench/nvidia-h100-80gb-hbm3.bench.json`" in side
    steps = _cells(side, "| qwen3-8b | 2048 | 4 | 64 |")
    assert steps[4:8] == ["1750.0 [1749.0–1752.0]", "2000.0 [1999.0–2002.0]", "1800.0 [1799.0–1802.0]",
                          "2100.0 [2099.0–2102.0]"]
    assert steps[8] == "30.00 / 24.94 / 25.00 / 25.50"
    model = _section(side, "#### Offloaded checkpointing: overlap model")
    cells = _cells(model, "| qwen3-8b | 2048 | 4 | 64 |")
    assert cells[4:7] == ["20.0 (19.5 @ 3.4 GB/s)", "30.0", "33"]
    assert cells[7:9] == ["640.0", "200.0"]
    assert cells[9] == "0.31 ⚠"  # 200 / 640, outside 0.5–1.5
    # 2000/1800 − 1 = +11.1%; the file's model figure; per layer 100·20/(20+30) = 40%.
    assert cells[10] == "+11.1% (model +47.1%, per layer ≤ 40.0%)"
    assert cells[11:13] == ["+2.9%", "+16.7%"]  # 1800/1750 − 1; 2100/1800 − 1
    assert cells[13] == "0.062 (peak +0.063) / 0.062"
    assert cells[14:] == ["5.00", "97.5%", "32/32"]
    fourteen = _cells(model, "| qwen3-14b | 8192 | 1 | 80 |")
    assert fourteen[9] == "0.66"  # 50 / 76, no flag
    assert fourteen[15:] == ["–", "–"]  # no trace
    # Missing fields render as "–", and the model sort is natural (8b before 14b).
    small = _cells(model, "| llama-3.2-1b | 1024 | 2 | – |")
    assert small[4:10] == ["– (–)", "–", "–", "–", "–", "–"]
    assert model.index("| qwen3-8b |") < model.index("| qwen3-14b |")
    assert "qwen3-32b T=8192 B=2 build: oom (CUDA out of memory. Tried to allocate 2 GiB)" in side


def test_offload_targets_pass_fail_and_unreachable(offload_readme):
    targets = _section(offload_readme, "## Targets")
    rows = {}
    for line in targets.splitlines():
        if line.startswith("| ") and not line.startswith("| target |"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    assert rows["double over single ≥ +8.4% (qwen3-8b T=2048 B=4)"] == [
        "+8.4% (0.3739→0.4053 steps/s, 8B, B200)", "+11.1% (bound +47.1%)", "yes"]  # 640/(2000−640)
    assert rows["double over single ≥ +6.7% (qwen3-14b T=8192 B=1)"] == [
        "+6.7% (0.2245→0.2395 steps/s, 14B, B200)", "+1.0% (bound +1.5%)", "no (unreachable: bound +1.5% < +6.7%)"]
    assert rows["second buffer ≤ one layer input (qwen3-8b T=2048 B=4)"][2] == "yes"
    assert rows["second buffer ≤ one layer input (qwen3-14b T=8192 B=1)"][2] == "no"  # peak +0.2 GiB > 80 MiB
    assert rows["second buffer ≤ one layer input (llama-3.2-1b T=1024 B=2)"] == ["–", "–", "–"]
    assert rows["double within 5% of none, peak below none (llama-3.2-1b T=1024 B=2)"] == ["–", "–", "–"]
    assert rows["double within 5% of none, peak below none (qwen3-8b T=2048 B=4)"][2] == "yes"
    assert rows["double within 5% of none, peak below none (qwen3-14b T=8192 B=1)"][1:] == [
        "step +10.0%, peak 30.20 vs 40.00 GiB", "no"]
    # 4900 < 4950: double is slower than save_on_cpu at the 14B point.
    assert rows["double faster than save_on_cpu at every point"][1:] == ["-1.0% … +16.7% over 2 points", "no"]
    assert not any("llama-3.2-1b" in k and "double over single" in k for k in rows)
    para = targets.split("\n\n")[-1]
    assert para.startswith("Double buffering can at best hide min(c, g)")
    assert "qwen3-14b T=8192 B=1: (39−1)·2.00 ms / 5000.0 ms → +1.5%" in para
    assert "not reachable where the bound is below it: qwen3-14b T=8192 B=1 (bound +1.5% < +6.7%)." in para
    assert "qwen3-8b T=2048 B=4 (bound" not in para


def test_offload_bound_reachable_everywhere():
    rows = _offload_point("qwen3-8b", 2048, 4, 64 * MIB, {"single": 2000.0, "double": 1700.0},
                          {"single": 1.0, "double": 1.0}, {"layers_reloaded": 33, "c_ms": 20.0, "g_ms": 30.0})
    points = report_bench.offload_points(rows)
    (gain,) = [t for t in report_bench.offload_targets(points) if t["target"].startswith("double over single")]
    assert gain["ok"] is True and gain["note"] == ""
    assert "reachable in principle" in report_bench.offload_bound_paragraph(points)


def _moe_rows() -> list[dict]:
    base = {"model": "gpt-oss-20b", "num_experts": 32, "top_k": 4, "num_layers": 24}

    def timing(f, b):
        return {"forward_ms": {"p20": f, "p50": f, "p80": f}, "backward_ms": {"p20": b, "p50": b, "p80": b}}

    return [
        {**base, "kind": "moe_routing", "backend": "loop", "tokens": 2048, "status": "ok", **timing(10.0, 5.0)},
        {**base, "kind": "moe_routing", "backend": "sorted", "tokens": 2048, "status": "ok", **timing(8.0, 4.5)},
        {**base, "kind": "moe_routing", "backend": "grouped_mm", "tokens": 2048, "status": "oom",
         "forward_ms": None, "backward_ms": None},
        {**base, "kind": "moe_routing", "backend": "loop", "tokens": 8192, "status": "ok", **timing(40.0, 20.0)},
        {**base, "kind": "moe_routing", "backend": "sorted", "tokens": 8192, "status": "ok", **timing(4.0, 10.0)},
        {**base, "kind": "moe_syncs", "backend": "loop", "tokens": 2048, "forward_counted": 32,
         "forward_observed": 33, "backward_counted": 0, "backward_observed": None, "per_model_forward": 768},
        {**base, "kind": "moe_query_model", "tokens": 2048, "queries_per_layer": {"loop": 32, "sorted": 1, "grouped_mm": 0},
         "per_query_ms": 0.0645, "per_query_ms_median": 0.0645, "predicted_saving_ms": 2.0,
         "measured_saving_ms": 2.0, "predicted_saving_per_model_forward_ms": 48.0},
        {**base, "kind": "moe_split_crossover", "projection": "gate_up_proj", "lora_rank": 64, "tokens": 2048,
         "crossover_tokens": 15480.0, "merged_lora_flops": 6e10, "split_lora_flops": 1e10},
        {**base, "kind": "moe_split_crossover", "projection": "down_proj", "lora_rank": 64, "tokens": 2048,
         "crossover_tokens": 11610.0, "merged_lora_flops": 3e10, "split_lora_flops": 5e9},
        {**base, "kind": "moe_experts", "backend": "grouped_mm", "lora": "merged", "tokens": 2048, "status": "ok",
         **timing(7.0, 5.0)},
        {**base, "kind": "moe_experts", "backend": "grouped_mm", "lora": "split", "tokens": 2048, "status": "ok",
         **timing(2.0, 3.0)},
    ]


def test_moe_routing_percent_and_targets(tmp_path):
    _write(tmp_path / "results" / "moe-bench" / f"{H100}.bench.json", {"env": ENV, "rows": _moe_rows()})
    text = report.build_report(tmp_path / "results", "moe", tmp_path / "reports").read_text()
    side = _section(text, "## Side-by-side benchmark (one process)")
    # 10/8 − 1 = +25.0% forward, 5/4.5 − 1 = +11.1% backward; the OOM backend says so.
    assert "| gpt-oss-20b | 2048 | 10.0 / 5.00 | 8.00 / 4.50 | OOM | +25.0% | +11.1% |" in side
    assert "| gpt-oss-20b | 8192 | 40.0 / 20.0 | 4.00 / 10.0 | – / – | +900.0% (10.00×) | +100.0% (2.00×) |" in side
    assert "| gpt-oss-20b | loop | 2048 | 32 / 33 | 0 / – | 768 |" in side
    assert "| gpt-oss-20b | 2048 | 32 / 1 / 0 | 0.065 (median 0.065) | 2.00 | 2.00 | 1.00 | 48.0 |" in side
    assert "| gpt-oss-20b | 2048 | 64 | 15,480 / 11,610 | 90.0 → 15.0 | 12.0 → 5.00 (grouped_mm) | 2.40× |" in side
    targets = _section(text, "## Targets")
    fwd = _cells(targets, "| routing forward, sorted over loop ≥ +23.0% (gpt-oss-20b T=2048)")
    bwd = _cells(targets, "| routing backward, sorted over loop ≥ +13.0% (gpt-oss-20b T=2048)")
    assert fwd[2:] == ["+25.0%", "yes"] and bwd[2:] == ["+11.1%", "no"]


def test_moe_routing_frame():
    (pt, _) = report_bench.moe_routing(_moe_rows())
    assert pt["sorted_over_loop_forward_ms"] == pytest.approx(25.0)
    assert pt["sorted_over_loop_backward_ms"] == pytest.approx(100 * (5.0 / 4.5 - 1))


M_LOG = """\
m  sdpa    T=  2048     0.366 ms (from lengths)     0.581 ms (from position_ids)
m  varlen  T=  8192     0.234 ms (from lengths)     0.494 ms (from position_ids)
model          T backend  (a counts table the bench prints later; not m lines)
"""


def test_packing_m_log_parsing(tmp_path):
    log = _write(tmp_path / "packing-bench" / f"{H100}.m.log", M_LOG)
    rows = report_bench.parse_m_log(log)
    assert [(r["backend"], r["seq_len"], r["from_position_ids"], r["m_ms"]) for r in rows] == [
        ("sdpa", 2048, False, 0.366), ("sdpa", 2048, True, 0.581),
        ("varlen", 8192, False, 0.234), ("varlen", 8192, True, 0.494)]
    text = report.build_report(tmp_path, "packing", tmp_path / "reports").read_text()
    assert "| sdpa | 2048 | 0.37 | 0.58 | 0.21 |" in text
    assert "| varlen | 8192 | 0.23 | 0.49 | 0.26 |" in text
    assert "## Targets" not in text


def test_packing_json_preferred_over_log(tmp_path):
    folder = tmp_path / "packing-bench"
    _write(folder / f"{H100}.m.log", M_LOG)
    m = [{"kind": "packing_m", "backend": "sdpa", "seq_len": 2048, "window": None, "sinks": False,
          "from_position_ids": pos, "m_ms": ms, "m_p20_ms": ms - 0.1, "m_p80_ms": ms + 0.1}
         for pos, ms in ((False, 1.5), (True, 2.5))]
    counts = {"kind": "packing_counts", "model": "qwen3-0.6b", "seq_len": 2048, "backend": "sdpa",
              "with_metadata": True, "num_layers": 28, "cache_on": {"packing_host_syncs": 0},
              "cache_off": {"packing_host_syncs": 28}, "m_ms": 1.5, "builds_on": 1, "builds_off": 57,
              "predicted_saving_ms": 84.0, "seeds_prediction_ms": 40.5}
    _write(folder / f"{H100}.bench.json", [*m, counts])  # bench_packing writes a bare list
    text = report.build_report(tmp_path, "packing", tmp_path / "reports").read_text()
    assert "| sdpa | 2048 | 1.50 [1.40–1.60] | 2.50 [2.40–2.60] | 1.00 |" in text
    assert "| varlen |" not in text  # the log of the same GPU is superseded
    assert "| qwen3-0.6b | 2048 | sdpa | yes | 28 | 1 / 57 | 0 / 28 | 1.50 | 84.0 | 40.5 |" in text


@pytest.mark.parametrize("name, content, match", [
    (f"{H100}.bench.json", '{"rows": [', "corrupt bench file, not JSON"),
    (f"{H100}.bench.json", '{"env": {}}', "expected a list of rows"),
    (f"{H100}.bench.json", '{"rows": [{"model": "x"}]}', "row 0 is not an object with a 'kind'"),
    (f"{H100}.m.log", "m  sdpa T= 2048 fast (from lengths)\n", "unreadable m line"),
    (f"{H100}.m.log", "nothing here\n", "no 'm  <backend> T= ...' lines"),
])
def test_malformed_bench_file_names_the_file(tmp_path, name, content, match):
    path = _write(tmp_path / "results" / "offload-bench" / name, content)
    with pytest.raises(report_bench.BenchFileError, match=match) as err:
        report.build_report(tmp_path / "results", "offload", tmp_path / "reports")
    assert str(path) in str(err.value)
    assert isinstance(err.value, ValueError)  # what report.py raises for a corrupt result row


def test_build_all_renders_bench_only_and_appends_to_existing(tmp_path):
    results = tmp_path / "results"
    _write(results / "offload-bench" / f"{H100}.bench.json", {"env": ENV, "rows": _offload_rows()})
    (results / "moe").mkdir(parents=True)
    shutil.copy(FIXTURE_RESULTS / "demo" / "cpu.jsonl", results / "moe" / "cpu.jsonl")
    _write(results / "moe-bench" / f"{H100}.bench.json", {"env": ENV, "rows": _moe_rows()})
    (results / "empty-bench").mkdir()  # no bench file: no report
    paths = report.build_all(results, tmp_path / "reports")
    assert paths == [tmp_path / "reports" / "moe" / "README.md", tmp_path / "reports" / "offload" / "README.md"]

    offload = paths[1].read_text()
    assert offload.startswith("# Benchmark report: offload\n")
    assert "no sweep rows, only the side-by-side benchmark" in offload
    assert "from `results/offload-bench/`; do not edit by hand." in offload
    assert "## Side-by-side benchmark (one process)" in offload and "## Targets" in offload

    moe = paths[0].read_text()
    # The sweep report is kept as it was; the bench sections come after it.
    assert "## cpu (`cpu`)" in moe and "### Results" in moe
    assert moe.index("### Methodology") < moe.index("## Side-by-side benchmark (one process)") < moe.index("## Targets")
    assert "from `results/moe/` and `results/moe-bench/`" in moe
    assert report.build_report(results, "moe", tmp_path / "again").read_text() == moe  # deterministic


def test_no_bench_dir_leaves_report_alone(tmp_path):
    assert report_bench.sections(FIXTURE_RESULTS, "demo") == []
    assert report_bench.experiments(tmp_path / "missing") == set()
    text = report.build_report(FIXTURE_RESULTS, "demo", tmp_path).read_text()
    assert "Side-by-side" not in text and "from `results/demo/`; do not edit by hand." in text


def test_odd_fields_render_dash_not_crash(tmp_path):
    rows = [
        {"kind": "offload", "model": "qwen3-8b", "seq_len": "2048", "mode": "double", "status": "ok",
         "step_ms": "fast", "peak_allocated_gib": None},
        {"kind": "offload_summary", "model": "qwen3-8b", "seq_len": "2048", "c_ms": "x", "g_ms": None,
         "layers_reloaded": True, "trace": [1, 2], "second_buffer_gib": float("nan")},
        {"kind": "moe_routing", "model": "m", "tokens": None, "backend": "loop", "forward_ms": [1]},
        {"kind": "moe_syncs", "model": "m"},
        {"kind": "moe_query_model", "queries_per_layer": 3},
        {"kind": "moe_split_crossover", "projection": "down_proj", "merged_lora_flops": "many"},
        {"kind": "packing_counts", "cache_on": {}, "cache_off": None},
        {"kind": "something_new"},
    ]
    _write(tmp_path / "x-bench" / f"{H100}.bench.json", {"rows": rows})
    text = report.build_report(tmp_path, "x", tmp_path / "reports").read_text()
    assert "None" not in text and "nan" not in text
    assert "| qwen3-8b | 0 | 0 | – | – | – | – | – | – / – / – / – |" in text


def test_moe_end_to_end_targets_from_sweep_rows():
    from harness.report_bench import moe_e2e_targets_md

    def row(t, v, p50, status="ok"):
        return {"kind": "step", "gpu_slug": "h", "device_name": "NVIDIA H100 80GB HBM3", "model": "gpt-oss-20b",
                "seq_len": t, "variant": v, "status": status,
                "step_ms": {"p20": p50, "p50": p50, "p80": p50} if status == "ok" else None}

    rows = [row(1024, "stock-grouped_mm", 600), row(1024, "grouped_mm-split", 250),
            row(2048, "stock-grouped_mm", 900), row(2048, "grouped_mm-split", 290),
            row(16384, "stock-grouped_mm", None, "oom"), row(16384, "grouped_mm-split", 1700),
            row(2048, "loop-merged", 3600), row(2048, "sorted-merged", 3000)]
    md = moe_e2e_targets_md(rows)
    # rows without a recording time count as one run ("unknown")
    assert ("| gpt-oss-20b | 2048 | unknown | 900.0 (stock-grouped_mm) | 290.0 (grouped_mm-split) | 3.10× | – | – "
            "| 293 (B200) | yes |") in md
    assert "| best ours ≥ 3× best stock at 2048 tokens (gpt-oss-20b) | 3.10× | yes |" in md
    assert "ours 1700.0, stock stock-grouped_mm: oom | yes |" in md
    assert "+20.0% (3600.0 → 3000.0 ms) | yes |" in md
    # 4096 and 8192 were not run: the every-length target is not judged
    assert "1024: yes, 2048: yes, 16384: yes | – |" in md
    # judged on the GPU the issue names for that model only (gpt-oss-20b: the H100)
    assert "ours below the seeds'" not in moe_e2e_targets_md([{**r, "device_name": "NVIDIA H200"} for r in rows])
    qwen = [{**r, "model": "qwen3-30b-a3b", "device_name": "NVIDIA H100 80GB HBM3"} for r in rows]
    assert "ours below the seeds'" not in moe_e2e_targets_md(qwen)
    assert "| 366 (H100) | yes (judged on the H200) |" in moe_e2e_targets_md(qwen)
    assert "ours below the seeds' H100 figures at every length (qwen3-30b-a3b) | 1024: yes" in \
        moe_e2e_targets_md([{**r, "device_name": "NVIDIA H200"} for r in qwen])


def test_moe_pairs_come_from_one_run_and_the_gap_is_fitted():
    from harness.report_bench import moe_e2e_targets_md, moe_pairs

    def row(t, v, p50, when, sha="c1", status="ok"):
        return {"kind": "step", "gpu_slug": "h", "device_name": "NVIDIA H100 80GB HBM3", "model": "gpt-oss-20b",
                "seq_len": t, "variant": v, "status": status, "recorded_at": when, "env": {"code_sha": sha},
                "step_ms": {"p20": p50, "p50": p50, "p80": p50} if status == "ok" else None}

    old, new = "2026-11-20T10:00:00+00:00", "2026-11-22T07:00:00+00:00"
    rows = [
        # an older run at 2048 had a faster stock row and the stock eager experts
        row(2048, "stock-grouped_mm", 500, old), row(2048, "grouped_mm-split", 400, old),
        row(2048, "stock-eager", 3000, "2026-11-20T10:05:00+00:00"),
        # the latest run: stock = 400 ms + 100 ms per 1k tokens, ours = 50 ms + 60 ms per 1k tokens
        *(r for t in (1024, 2048, 4096, 8192)
          for r in (row(t, "stock-grouped_mm", 400 + 100 * t / 1024, new),
                    row(t, "grouped_mm-split", 50 + 60 * t / 1024, new))),
        row(4096, "stock-eager", 4000, "2026-11-22T07:20:00+00:00"),
        # a later run that measured only ours at 8192: no pair in it, so the earlier run stands
        row(8192, "grouped_mm-split", 100, "2026-11-23T00:00:00+00:00"),
        # a different code hash within 30 minutes is a different run
        row(1024, "stock-grouped_mm", 200, "2026-11-22T07:10:00+00:00", sha="c2"),
    ]
    pairs = moe_pairs(rows, "gpt-oss-20b")
    assert pairs[2048]["stock"] == 600 and pairs[2048]["ours"] == 170 and pairs[2048]["one_run"]
    assert pairs[2048]["eager"] == 3000 and not pairs[2048]["eager_same_run"]
    assert pairs[4096]["eager"] == 4000 and pairs[4096]["eager_same_run"]
    assert pairs[8192]["ours"] == 530 and pairs[1024]["stock"] == 500
    md = moe_e2e_targets_md(rows)
    assert "| gpt-oss-20b | 2048 | 11-22 07:00 | 600.0 (stock-grouped_mm) | 170.0 (grouped_mm-split) | 3.53× | 3000.0 (other run) | – |" in md
    assert "| 4000.0 | 13.8× |" in md
    assert ("stock takes 400 ms + 100.0 ms per 1k tokens and ours 50 ms + 60.0 ms per 1k tokens. The fixed parts "
            "differ 8.0×, the per-token parts 1.67×, so stock / ours falls with length toward 1.67×. A rising ratio "
            "needs ours to cost less than 12.5 ms per 1k tokens") in md
    assert "1024: 390.0, 2048: 430.0, 4096: 510.0, 8192: 670.0." in md
    assert "| the gap grows with sequence length (gpt-oss-20b) | 1024: 4.55×, 2048: 3.53×, 4096: 2.76×, 8192: 2.26× | no |" in md
    # only one side anywhere: each side's best over all runs, no ratio
    solo = moe_pairs([row(2048, "grouped_mm-split", 170, new), row(2048, "stock-grouped_mm", 600, old)], "gpt-oss-20b")
    assert not solo[2048]["one_run"] and solo[2048]["run"] == "different runs"


def _profile_summary(**over):
    s = {"model": "gpt-oss-20b", "seq_len": 8192, "variant": "ours", "steps": 1, "device_name": "NVIDIA H100",
         "profiled": "eager steps",
         "phases": {"forward": {"gpu_span_ms": 200.0, "cpu_span_ms": 150.0, "gpu_busy_pct": 75.0, "launches": 10,
                                "host_syncs": 0}},
         "top_kernels": [{"name": "cutlass_GroupProblemShape_x", "ms": 300.0, "count": 4},
                         {"name": "triton_tem_fused_flex_attention_backward", "ms": 100.0, "count": 2},
                         {"name": "Memcpy DtoD (Device -> Device)", "ms": 50.0, "count": 9},
                         {"name": "masked_fill_kernel", "ms": 30.0, "count": 9}],
         "kernel_ms_total": 500.0}
    return {**s, **over}


def test_profile_section_splits_kernel_time_by_family(tmp_path):
    _write(tmp_path / "x" / "profiles" / H100 / "a.summary.json", _profile_summary())
    text = report.build_report(tmp_path, "x", tmp_path / "reports").read_text()
    assert "## Where the step's time goes (profiles)" in text
    assert "| forward | 200.0 | 150.0 | 75.0% | 10 | 0 |" in text
    assert "| grouped GEMM (torch grouped_mm) | 300.0 | 60.0% | 37.5 |" in text
    assert "| copies and fills | 50.0 | 10.0% | 6.2 |" in text
    assert "| other (elementwise, reductions, indexing) | 30.0 | 6.0% | 3.8 |" in text  # masked_fill is not a fill
    assert "| kernels outside the top 4 | 20.0 | 4.0% | 2.5 |" in text
    assert "| all kernels | 500.0 | 100.0% | 62.5 |" in text
    (tmp_path / "x" / "profiles" / H100 / "b.summary.json").write_text('{"phases": {}}')
    with pytest.raises(report_bench.BenchFileError, match="b.summary.json: not a harness profile summary"):
        report.build_report(tmp_path, "x", tmp_path / "reports")


def test_packing_cache_predicted_vs_measured():
    from harness.report_bench import packing_cache_points

    def row(cache, p50, builds):
        return {"kind": "step", "status": "ok", "gpu_slug": "g", "model": "qwen3-0.6b", "seq_len": 8192,
                "num_layers": 28, "measured_steps": 10, "step_ms": {"p20": p50, "p50": p50, "p80": p50},
                "switches": {"packing_backend": "varlen", "packing_cache": cache},
                "packing_counters": {"varlen_args": builds, "metadata": builds}}

    m = [{"kind": "packing_m", "gpu_slug": "g", "backend": "varlen", "seq_len": 8192,
          "from_position_ids": False, "m_ms": 0.5, "window": None, "sinks": False},
         {"kind": "packing_m", "gpu_slug": "other", "backend": "varlen", "seq_len": 8192,
          "from_position_ids": False, "m_ms": 9.0, "window": None, "sinks": False}]
    (p,) = packing_cache_points([row(True, 400.0, 10), row(False, 430.0, 560)], m)
    assert (p["builds_on"], p["builds_off"], p["m_ms"]) == (1.0, 56.0, 0.5)
    assert p["predicted_ms"] == pytest.approx(27.5) and p["seeds_ms"] == pytest.approx(13.5)
    assert p["measured_ms"] == pytest.approx(30.0) and p["ratio"] == pytest.approx(30 / 27.5)
    assert p["gain_pct"] == pytest.approx(7.5)
    assert p["predicted_device_ms"] is None  # this bench row has no device split
    # a point measured with the cache on only gives no row
    assert packing_cache_points([row(True, 400.0, 10)], m) == []
    # with the device part of m recorded: what a GPU-bound step must still pay per rebuild
    m[0]["m_device_ms"] = 0.1
    (p,) = packing_cache_points([row(True, 400.0, 10), row(False, 430.0, 560)], m)
    assert p["predicted_device_ms"] == pytest.approx(5.5)
    assert p["ratio_device"] == pytest.approx(30 / 5.5)


def test_packing_cache_md_sorts_pairs_by_who_bounds_the_step():
    from harness.report_bench import packing_cache_md

    def row(t, cache, p50, spread, builds):
        return {"kind": "step", "status": "ok", "gpu_slug": "g", "model": "qwen3-0.6b", "seq_len": t,
                "num_layers": 28, "measured_steps": 10,
                "step_ms": {"p20": p50, "p50": p50, "p80": p50 * spread},
                "switches": {"packing_backend": "flex", "packing_cache": cache},
                "packing_counters": {"flex_block_mask": builds}}

    m = [{"kind": "packing_m", "gpu_slug": "g", "backend": "flex", "seq_len": t, "from_position_ids": False,
          "m_ms": 2.5, "m_device_ms": 0.3, "window": None, "sinks": False} for t in (2048, 8192, 16384)]
    rows = [row(16384, True, 700.0, 1.001, 10), row(16384, False, 716.0, 1.001, 560),   # GPU-bound
            row(8192, True, 700.0, 1.04, 10), row(8192, False, 701.0, 1.04, 560),       # within its band
            row(2048, True, 400.0, 1.2, 10), row(2048, False, 530.0, 1.2, 560)]         # host-bound
    md = packing_cache_md(rows, m)
    # 16 ms saved of a 16.5 ms device part; 2048: 130 ms of 137.5 ms predicted from the whole m
    assert "- GPU-bound: measured / device part median 0.97, range 0.97–0.97, 1 pairs." in md
    assert "1 more GPU-bound pairs predict a device part within their steps' p20–p80 band" in md
    assert "- Host-bound: measured / predicted (the whole m) median 0.95, range 0.95–0.95, 1 pairs." in md


def test_packing_cache_md_names_lengths_without_m():
    from harness.report_bench import packing_cache_md

    rows = [_packing_row("packed-flex", 400.0, seq_len=16384), _packing_row("packed-flex-nocache", 410.0, seq_len=16384)]
    md = packing_cache_md(rows, [])
    assert "device part of it ms" in md and "The bench has no m for 16384 tokens on g" in md


def test_measure_m_splits_host_time_from_device_time():
    from harness.bench_packing import measure_m

    r = measure_m("sdpa", 256, warmup=1, repeats=3, device=torch.device("cpu"))
    assert r["m_host_ms"] > 0 and r["m_device_ms"] is None and r["m_ms"] == pytest.approx(r["m_host_ms"])


def _packing_row(variant, p50, *, model="qwen3-0.6b", seq_len=8192, status="ok", peak=None,
                 at="2026-11-22T00:30:00+00:00", sha="aaaa1111", spread=1.0, **switches) -> dict:
    backend = "off" if variant.startswith("stock-") else variant.split("-")[1]
    sw = {"packing_backend": backend, **switches}
    if variant.endswith("-compiled"):
        sw["compile_layers"] = True
    if variant.startswith("packed-") and not variant.endswith("-compiled"):
        sw.setdefault("packing_cache", not variant.endswith("-nocache"))
    return {"kind": "step", "gpu_slug": "g", "model": model, "seq_len": seq_len, "variant": variant,
            "status": status, "switches": sw, "batch_size": 1, "num_layers": 28, "measured_steps": 10,
            "step_ms": {"p20": p50, "p50": p50, "p80": p50 * spread} if status == "ok" else None,
            "peak_allocated_gib": peak, "recorded_at": at, "env": {"git_sha": sha}}


def test_packing_cache_compiled_rows_do_not_collide():
    from harness.report_bench import packing_cache_md, packing_cache_points

    # compiled rows that record the cache default must not become the "on" row of the uncompiled pair
    rows = [_packing_row("packed-flex-compiled", 200.0, packing_cache=True),
            _packing_row("packed-flex", 400.0), _packing_row("packed-flex-nocache", 500.0)]
    (p,) = packing_cache_points(rows, [])
    assert (p["compiled"], p["on_ms"], p["off_ms"]) == (False, 400.0, 500.0)
    # a compiled on/off pair, should one be run, is its own point with its own label
    rows.append(_packing_row("packed-flex-compiled", 260.0, packing_cache=False))
    pts = packing_cache_points(rows, [])
    assert [(q["compiled"], q["on_ms"], q["off_ms"]) for q in pts] == [(False, 400.0, 500.0), (True, 200.0, 260.0)]
    md = packing_cache_md(rows, [])
    assert "| g | qwen3-0.6b | 8192 | flex | " in md and "| g | qwen3-0.6b | 8192 | flex (compiled) | " in md


def test_packing_best_packed_vs_stock_flex_met():
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("stock-flex", 500.0, at="2026-11-22T00:30:00+00:00"),
            _packing_row("stock-flex-compiled", 250.0),
            _packing_row("packed-flex", 400.0),
            _packing_row("packed-sdpa", None, status="oom"),
            _packing_row("packed-varlen-compiled", 200.0, at="2026-11-22T00:40:00+00:00"),
            _packing_row("stock-flex", 300.0, seq_len=2048)]  # no packed row at 2048
    md = packing_targets_md(rows, [])
    assert ("| best packed path ≥ 1.3× faster than stock flex_attention, qwen3-0.6b at 8192 tokens "
            "(REFERENCE: stock 411 ms on the H100) | 2.50× (stock-flex 500.0 → packed-varlen-compiled 200.0 ms); "
            "over stock-flex-compiled 1.25× | met |") in md
    assert "| g | qwen3-0.6b | 8192 | 500.0 | 200.0 (packed-varlen-compiled) | 2.50× | 250.0 | 1.25× |" in md
    assert "| g | qwen3-0.6b | 2048 | 300.0 | not run | – | – | – |" in md
    assert "same sweep file" in md
    assert ("stock-flex recorded 2026-11-22T00:30:00+00:00 (git aaaa1111) and packed-varlen-compiled recorded "
            "2026-11-22T00:40:00+00:00 (git aaaa1111): they are 10 minutes apart running the same code, so they likely "
            "come from one run.") in md


def test_packing_best_packed_vs_stock_flex_not_met_and_different_runs():
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("stock-flex", 500.0, at="2026-11-21T20:00:00+00:00"),
            _packing_row("packed-flex", 450.0, at="2026-11-22T00:00:00+00:00")]
    md = packing_targets_md(rows, [])
    assert "| 1.11× (stock-flex 500.0 → packed-flex 450.0 ms); over stock-flex-compiled – | not met |" in md
    assert "they are 240 minutes apart, so they come from different runs." in md
    # within 30 minutes but at another commit: still different runs
    rows[1].update(recorded_at="2026-11-21T20:05:00+00:00", env={"git_sha": "bbbb2222"})
    assert "ran different code (commits or code hashes differ), so they come from different runs." \
        in packing_targets_md(rows, [])
    # different commits but one hash of the measuring code (a commit that added only results): one run
    rows[0]["env"] = {"git_sha": "aaaa1111", "code_sha": "c0de"}
    rows[1]["env"] = {"git_sha": "bbbb2222", "code_sha": "c0de"}
    assert "5 minutes apart running the same code, so they likely come from one run." in packing_targets_md(rows, [])


def test_packing_targets_missing_stock_flex_and_odd_rows():
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-varlen", 380.0, peak=15.0),
            {"kind": "step"}, {"kind": "step", "variant": "stock-flex", "status": "ok", "step_ms": "fast"},
            {"kind": "step", "variant": "packed-sdpa", "model": "qwen3-0.6b", "seq_len": "8192", "status": "ok",
             "switches": None, "recorded_at": None, "peak_allocated_gib": float("nan")}]
    md = packing_targets_md(rows, [])
    assert "None" not in md and "nan" not in md
    assert "qwen3-0.6b at 8192 tokens (REFERENCE: stock 411 ms on the H100) | not measured | – |" in md
    assert "#### Best packed path vs stock flex_attention" not in md
    assert "| g | qwen3-0.6b | 8192 | – | – | 15.000 | – / – | 0.062 | yes |" in md
    # a stock-flex row but no packed path at all: stated, not judged
    md = packing_targets_md([_packing_row("stock-flex", 500.0)], [])
    assert "| stock-flex 500.0 ms, no packed row | – |" in md
    # and nothing at all still renders the target lines
    assert "not measured" in packing_targets_md([], [])
    assert report_bench.sweep_targets("packing", [{"kind": "step"}]) != []


def test_packing_cache_gain_vs_seeds():
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0), _packing_row("packed-flex-nocache", 500.0),  # +25%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 420.0),  # +5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b"),
            _packing_row("packed-sdpa-nocache", 303.0, model="llama-3.2-1b")]  # +1%
    md = packing_targets_md(rows, [])
    assert ("| cache on saves ≥ the seeds' +14.8% per step (qwen3-0.6b) | best +25.0% (flex, 8192 tokens; "
            "spread ±0%) | met |") in md
    assert ("| cache on saves ≥ the seeds' +11.5% per step (llama-3.2-1b) | best +1.0% (sdpa, 8192 tokens; spread ±0%) | "
            "not met: see the measured / predicted column; the saving is (builds_off − builds_on)·m |") in md
    assert "| cache on saves ≥ the seeds' +14.3% per step (qwen3-14b) | not measured | – |" in md


def test_packing_cache_gain_within_noise_is_not_judged():
    """Host-bound rows: a gain smaller than the rows' own p80/p20 spread measures nothing; the
    largest gain that clears its spread is the one judged."""
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("packed-flex", 400.0, spread=1.4), _packing_row("packed-flex-nocache", 500.0),  # +25% < 40%
            _packing_row("packed-varlen", 400.0), _packing_row("packed-varlen-nocache", 440.0, spread=1.05),  # +10% > 5%
            _packing_row("packed-sdpa", 300.0, model="llama-3.2-1b", spread=1.3),
            _packing_row("packed-sdpa-nocache", 330.0, model="llama-3.2-1b")]  # +10% < 30%
    md = packing_targets_md(rows, [])
    assert "(qwen3-0.6b) | best +10.0% (varlen, 8192 tokens; spread ±5%) | not met" in md
    assert "(llama-3.2-1b) | best +10.0% (sdpa, 8192 tokens; spread ±30%) | within noise" in md


def test_packing_peak_memory_side_by_side():
    from harness.report_bench import packing_targets_md

    rows = [_packing_row("packed-sdpa", 410.0, peak=15.8), _packing_row("packed-flex", 400.0, peak=15.7),
            _packing_row("packed-varlen", 390.0, peak=15.75, at="2026-11-22T02:00:00+00:00"),
            _packing_row("packed-flex-compiled", 200.0, peak=1.0)]  # compiled: not in this table
    md = packing_targets_md(rows, [])
    assert "`tests/test_gpu_packing.py` (a GPU test) asserts it" in md
    assert "| g | qwen3-0.6b | 8192 | 15.800 | 15.700 | 15.750 | +0.100 / +0.050 | 0.062 | no |" in md


def test_moe_fit_splits_the_measured_peak_and_projects_each_change():
    from harness.report_bench import moe_fit_md

    def row(t, peak, device="NVIDIA H200", cap=139.8):
        return {"kind": "step", "status": "ok", "model": "qwen3-30b-a3b", "variant": "grouped_mm-split",
                "seq_len": t, "peak_allocated_gib": peak, "total_params": 33e9, "trainable_params": 2.5e9,
                "dtype": "bf16", "lora_rank": 64, "device_name": device, "env": {"memory_total_gib": cap}}

    h100 = {"kind": "step", "status": "ok", "model": "gpt-oss-20b", "variant": "stock-grouped_mm",
            "device_name": "NVIDIA H100", "env": {"memory_total_gib": 79.6}}
    md = moe_fit_md([row(1024, 96.0), row(8192, 104.0), h100])
    frozen, state = 30.5e9 * 2 / 2**30, 2.5e9 * 4 * 4 / 2**30  # 56.8 and 37.3 GiB
    assert "on one NVIDIA H100" in md and f"{frozen + state:.1f} GiB" in md
    # bf16 adapters save half the state, from the larger of the zero-token line and weights + state
    base = max(96.0 - 8.0 / 7168 * 1024, frozen + state)
    assert f"| adapters in bf16 (`lora_dtype = \"model\"`) | {state / 2:.1f} | {base - state / 2:.1f} |" in md
    assert "| as measured (adapters fp32, peft's default) | 0.0 |" in md and "(none)" in md
    # a bf16-adapter row does not bend the fp32 line
    bf16 = {**row(8192, 80.0), "variant": "grouped_mm-split-bf16lora", "lora_dtype": "model"}
    with_bf16 = moe_fit_md([row(1024, 96.0), row(8192, 104.0), bf16, h100])
    assert with_bf16.startswith(md)
    # ... and is set beside the table's projection for it
    assert with_bf16.endswith(f"8192 tokens on the NVIDIA H200: 80.0 GiB (projected {base - state / 2 + 8.0 / 7168 * 8192:.1f}).")
    # one length only, or no GPU capacity recorded: nothing to say
    assert moe_fit_md([row(1024, 96.0), h100]) == ""


def test_code_sha_tracks_the_measuring_code_only(tmp_path, monkeypatch):
    from harness import env

    monkeypatch.setattr(env, "REPO_ROOT", tmp_path)
    for pkg in ("optim", "harness"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    first = env.code_sha()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.py").write_text("y = 2\n")  # not measuring code
    assert env.code_sha() == first
    (tmp_path / "optim" / "a.py").write_text("x = 2\n")
    assert env.code_sha() != first


def test_packing_vs_stock_keeps_a_point_whose_stock_run_failed():
    from harness.report_bench import packing_targets_md

    failed = _packing_row("stock-flex", None, seq_len=16384, status="error")
    failed["message"] = "timed out after 150 s"
    md = packing_targets_md([failed, _packing_row("packed-flex", 700.0, seq_len=16384)], [])
    assert "| g | qwen3-0.6b | 16384 | error: timed out after 150 s | 700.0 (packed-flex) | – |" in md
