"""Shared by the report tests: rows stored the way the benches and sweeps store them (the tests
read a report's tables as data through ``harness.report.fmt.recording``)."""

from __future__ import annotations

from pathlib import Path

from harness import results as res

FIXTURE_RESULTS = Path(__file__).parent / "fixtures" / "results"
H100 = "nvidia-h100-80gb-hbm3"
ENV = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "git_sha": "0123456789abcdef"}
MIB, GIB = 2**20, 2**30
COMMAND = "python -m harness.bench.x --test"


def store(results: Path, experiment: str, rows: list[dict], env: dict = ENV) -> Path:
    """Microbenchmark rows into results/<experiment>/<gpu>.jsonl, as ``harness.bench`` stores them."""
    return res.write_bench_rows(results, experiment, rows, env=env, command=COMMAND)


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
    # A model with no published figure, with a summary missing every field.
    small = _offload_point("llama-3.2-1b", 1024, 2, None, {"double": 90.0}, {"double": None}, {})
    oom = [{"kind": "offload", "model": "qwen3-32b", "seq_len": 8192, "batch_size": 2, "mode": "build",
            "status": "oom", "message": "CUDA out of memory.\nTried to allocate 2 GiB"}]
    return eight + fourteen + small + oom


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
         "forward_observed": 33, "backward_counted": 0, "backward_observed": None, "per_model_forward": 768,
         "observed_syncs_only": True},
        {**base, "kind": "moe_query_model", "tokens": 2048, "queries_per_layer": {"loop": 32, "sorted": 1, "grouped_mm": 0},
         "per_query_ms": 0.0645, "per_query_ms_median": 0.0645, "predicted_saving_ms": 2.0,
         "measured_saving_ms": 2.0, "predicted_saving_per_model_forward_ms": 48.0},
        {**base, "kind": "moe_query_model", "tokens": 8192, "queries_per_layer": {"loop": 32, "sorted": 1, "grouped_mm": 0},
         "per_query_ms": 0.129, "per_query_ms_median": 0.0968, "predicted_saving_ms": 3.0,
         "measured_saving_ms": 3.0, "predicted_saving_per_model_forward_ms": 72.0},
        {**base, "kind": "moe_split_crossover", "projection": "gate_up_proj", "lora_rank": 64, "tokens": 2048,
         "crossover_tokens": 15480.0, "merged_lora_flops": 6e10, "split_lora_flops": 1e10},
        {**base, "kind": "moe_split_crossover", "projection": "down_proj", "lora_rank": 64, "tokens": 2048,
         "crossover_tokens": 11610.0, "merged_lora_flops": 3e10, "split_lora_flops": 5e9},
        {**base, "kind": "moe_experts", "backend": "grouped_mm", "lora": "merged", "tokens": 2048, "status": "ok",
         **timing(7.0, 5.0)},
        {**base, "kind": "moe_experts", "backend": "grouped_mm", "lora": "split", "tokens": 2048, "status": "ok",
         **timing(2.0, 3.0)},
    ]


def spec(section: str) -> dict:
    """``[report.<section>]`` of the repository's experiment file of that name: the tests judge
    against the targets the reports use."""
    from harness.run import experiment

    return experiment.load(Path(__file__).parents[1] / "experiments" / f"{section}.toml").report[section]


def keep_experiment(results: Path, name: str) -> Path:
    """The repository's experiments/<name>.toml kept under results/<name>/experiments/, as a sweep
    keeps it."""
    from harness.run import experiment, sweep

    return sweep.keep_experiment_file(experiment.load(Path(__file__).parents[1] / "experiments" / f"{name}.toml"), results)
