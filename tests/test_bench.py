"""The microbenchmarks' own measurements and their rows in the results store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from harness import results as res
from harness.bench import packing as bench_packing
from harness.report import fmt


def test_measure_m_splits_host_time_from_device_time():
    r = bench_packing.measure_m("sdpa", 256, warmup=1, repeats=3, device=torch.device("cpu"))
    assert r["m_host_ms"] > 0 and r["m_device_ms"] is None and r["m_ms"] == pytest.approx(r["m_host_ms"])


def test_bench_rows_land_beside_the_sweep_rows_and_a_rerun_replaces_its_own(tmp_path):
    env = {"device_name": "NVIDIA H100 80GB HBM3", "git_sha": "abc"}
    m = [{"kind": "packing_m", "backend": b, "seq_len": 2048, "from_position_ids": False, "window": None,
          "sinks": False, "m_ms": ms} for b, ms in (("sdpa", 1.0), ("flex", 2.0))]
    res.append_row(res.results_path(tmp_path, "packing", "nvidia-h100-80gb-hbm3"),
                   {"kind": "step", "point_id": "p1", "status": "ok"})
    path = res.write_bench_rows(tmp_path, "packing", m, env=env, command="python -m harness.bench.packing --x")
    assert path == tmp_path / "packing" / "nvidia-h100-80gb-hbm3.jsonl"
    again = [{**m[1], "m_ms": 3.0}]
    res.write_bench_rows(tmp_path, "packing", again, env=env, command="python -m harness.bench.packing --y")
    rows = res.read_rows(path)
    assert [r["kind"] for r in rows] == ["step", "packing_m", "packing_m"]
    by_backend = {r["backend"]: r for r in rows if r["kind"] == "packing_m"}
    assert by_backend["sdpa"]["m_ms"] == 1.0 and by_backend["flex"]["m_ms"] == 3.0
    assert by_backend["flex"]["command"].endswith("--y") and by_backend["flex"]["env"] == env
    assert {r["gpu_slug"] for r in rows if r["kind"] == "packing_m"} == {"nvidia-h100-80gb-hbm3"}
    # a rerun that failed (an OOM, a crash) keeps the measurement beside it; the next failure replaces it,
    # and the next measurement replaces both
    flex = [r for r in rows if r.get("backend") == "flex"]
    for failed in ({**m[1], "status": "oom", "m_ms": None}, {**m[1], "status": "error", "m_ms": None}):
        res.write_bench_rows(tmp_path, "packing", [failed], env=env, command="z")
        got = [r for r in res.read_rows(path) if r.get("backend") == "flex"]
        assert [(r.get("status", "ok"), r["m_ms"]) for r in got] == [("ok", 3.0), (failed["status"], None)]
    assert flex[0]["m_ms"] == 3.0
    res.write_bench_rows(tmp_path, "packing", [{**m[1], "m_ms": 4.0}], env=env, command="w")
    assert [r["m_ms"] for r in res.read_rows(path) if r.get("backend") == "flex"] == [4.0]


def test_a_row_of_unknown_kind_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match="not a microbenchmark row kind: 'step'"):
        res.write_bench_rows(tmp_path, "x", [{"kind": "step"}], env={}, command="c")
    assert not (tmp_path / "x" / "cpu.jsonl").exists()


def test_bench_main_stores_rows_with_its_command(tmp_path):
    code = bench_packing.main(["--results", str(tmp_path), "--lengths", "64", "--backends", "sdpa",
                               "--repeats", "2", "--m-only"])
    assert code == 0
    (path,) = tmp_path.glob("packing/*.jsonl")
    rows = res.read_rows(path)
    assert {r["kind"] for r in rows} == {"packing_m"}
    assert rows[0]["command"] == ("python -m harness.bench.packing --results " + str(tmp_path)
                                  + " --lengths 64 --backends sdpa --repeats 2 --m-only")
    assert json.dumps(rows)  # plain JSON


def test_loss_bench_rows_and_their_report_table(tmp_path):
    from harness.bench import loss as bench_loss
    from harness.report import build_report

    code = bench_loss.main(["--results", str(tmp_path), "--shapes", "tiny", "--modes", "frozen",
                            "--kernels", "stock", "optim-eager", "cce", "--warmup", "0", "--repeats", "2"])
    assert code == 0
    rows = {r["backend"]: r for r in res.read_rows(tmp_path / "loss" / "cpu.jsonl")}
    assert rows["stock"]["status"] == rows["optim-eager"]["status"] == "ok"
    # the chunked loss is as exact as stock against fp32: same-size errors, not just "small"
    assert rows["optim-eager"]["grad_h_err"] < 2 * rows["stock"]["grad_h_err"] + 1e-6
    assert rows["cce"]["status"] == "unavailable" and "cut-cross-entropy" in rows["cce"]["error"]
    text = build_report(tmp_path, "loss", tmp_path / "reports").read_text()
    assert "#### Linear + cross-entropy kernels" in text
    assert "| optim-eager |" in text and "unavailable: cut-cross-entropy" in text


@pytest.mark.slow
def test_a_trainer_bench_run_that_dies_is_its_own_error_row_and_the_others_still_run(tmp_path):
    from harness.bench import trainer as bench_trainer

    stored = []
    kw = dict(max_length=64, doc_len=32, lora_rank=4, steps=2, warmup=1, device="cpu", attn_implementation="sdpa",
              experts_implementation=None, on_row=lambda row, env: stored.append((row, env)))
    # a TrainingArguments field that does not exist: each run's process raises, and says so
    rows = bench_trainer.run("qwen3-0.6b-tiny", ["stock", "ours"], trainer_args={"no_such_field": 1}, **kw)
    assert [(r["mode"], r["status"]) for r in rows] == [("stock", "error"), ("ours", "error")]
    assert [row for row, _ in stored] == rows
    assert "exited with code 1 without a result" in rows[0]["error"] and "no_such_field" in rows[0]["log_tail"]
    # a dead run's row still says which code and device it ran on, read without a CUDA context
    from harness.measure import env as envmod

    assert {env["device_name"] for _, env in stored} == {"cpu"}
    assert {env["code_id"] for _, env in stored} == {envmod.code_id()}
    # a run past its time is killed, and its row says so
    (late,) = bench_trainer.run("qwen3-0.6b-tiny", ["stock"], timeout_s=1.0, **kw)
    assert late["status"] == "error" and late["error"] == "timed out after 1 s", late
    # a model the bench does not know: one clear error before anything runs
    with pytest.raises(SystemExit):
        bench_trainer.main(["--results", str(tmp_path), "--model", "no-such-model", "--runs", "stock"])
    assert not list(tmp_path.rglob("*.jsonl"))


@pytest.mark.slow
def test_trainer_bench_rows_and_their_report_table(tmp_path):
    from harness.bench import trainer as bench_trainer
    from harness.report import build_report

    code = bench_trainer.main(["--results", str(tmp_path), "--experiment", "t", "--model", "qwen3-0.6b-tiny",
                               "--runs", "stock", "compiled", "ours", "liger", "--max-length", "64", "--doc-len", "32",
                               "--lora-rank", "4", "--steps", "3", "--warmup", "1", "--attn-implementation", "sdpa",
                               "--trainer-arg", "logging_nan_inf_filter=false"])
    assert code == 0
    rows = {r["mode"]: r for r in res.read_rows(tmp_path / "t" / "cpu.jsonl")}
    assert set(rows) == {"stock", "compiled", "ours", "liger"} and len(rows["ours"]["losses"]) == 3
    # the same documents per step: ours and the compiled peer follow stock's loss curve (fp32 on CPU)
    assert rows["ours"]["max_rel_loss_diff_vs_stock"] < 1e-4
    assert rows["compiled"]["max_rel_loss_diff_vs_stock"] < 1e-4 and rows["compiled"]["optim"] is None
    # Liger-Kernel's Triton kernels need CUDA: a skipped row that says so, not an error
    assert rows["liger"]["status"] == "skipped" and "CUDA" in rows["liger"]["error"]
    assert rows["ours"]["optim"]["optim.loss"]["fused_loss"] is True
    # each step's host time, begin to end callback; on CPU it holds the step's clock marks within it
    for mode in ("stock", "compiled", "ours"):
        r = rows[mode]
        assert len(r["issue_ms_samples"]) == len(r["ms_samples"]) == 2 and r["issue_ms"] >= r["ms"] > 0, r
    # each timed step's cycle collections by generation, the collector as CPython sets it: on the CPU
    # the layers run eagerly and collect, ours too (optim.enable leaves the collector by default)
    assert all(rows[m]["gc_collections_per_step"][0] > 0 for m in ("stock", "ours"))
    assert {r["logging_steps"] for r in rows.values()} == {500}  # Trainer's default: no log, no sync, per step
    assert {json.dumps(r["trainer_args"]) for r in rows.values()} == {'{"logging_nan_inf_filter": false}'}
    text = build_report(tmp_path, "t", tmp_path / "reports").read_text()
    assert "#### transformers.Trainer" in text and "| Trainer after optim.enable(model) |" in text
    assert "| stock Trainer, decoder layers compiled |" in text and "| Trainer(use_liger_kernel=True) | skipped:" in text
    assert "Trainer logging every 500 steps, TrainingArguments logging_nan_inf_filter=False" in text
    # the host's time per step beside the step time; a skipped row has none
    assert "| run | ms/step | host ms | × stock |" in text
    ours = next(line for line in text.splitlines() if line.startswith("| Trainer after optim.enable(model) |"))
    assert ours.split(" | ")[2] == fmt.ms(rows["ours"]["issue_ms"]), ours


def test_a_profiled_trainer_bench_writes_trainer_phases_and_stores_no_rows(tmp_path, capsys):
    from harness.bench import trainer as bench_trainer

    prof = tmp_path / "prof"
    args = ["--results", str(tmp_path), "--experiment", "t", "--model", "qwen3-0.6b-tiny", "--runs", "ours",
            "--max-length", "64", "--doc-len", "32", "--lora-rank", "4", "--steps", "4", "--warmup", "1",
            "--attn-implementation", "sdpa"]
    with pytest.raises(SystemExit):  # more profiled steps than follow the warm-up: refused before any run
        bench_trainer.main([*args, "--profile", str(prof), "--profile-steps", "4"])
    assert not prof.exists()
    assert bench_trainer.main([*args, "--profile", str(prof), "--profile-steps", "2"]) == 0
    # the profiler's times are not the bench's: nothing is stored
    assert not list(tmp_path.rglob("*.jsonl"))
    s = json.loads((prof / "trainer-qwen3-0.6b-tiny-64-ours.summary.json").read_text())
    assert list(s["phases"]) == ["forward_backward", "optimizer", "step_end"] and s["steps"] == 2
    assert s["phases"]["forward_backward"]["cpu_span_ms"] > 0 and s["phases"]["optimizer"]["cpu_span_ms"] > 0
    assert (prof / "trainer-qwen3-0.6b-tiny-64-ours.cpu.txt").read_text().strip()
    assert "rows not stored" in capsys.readouterr().out


def test_a_host_profiled_trainer_bench_writes_each_runs_python_per_step_and_stores_no_rows(tmp_path, capsys):
    import pstats

    from harness.bench import trainer as bench_trainer

    prof = tmp_path / "prof"
    args = ["--results", str(tmp_path), "--experiment", "t", "--model", "qwen3-0.6b-tiny", "--runs", "stock", "ours",
            "--max-length", "64", "--doc-len", "32", "--lora-rank", "4", "--steps", "4", "--warmup", "1",
            "--attn-implementation", "sdpa"]
    for bad in (["--host"], ["--profile", str(prof), "--host", "--trace"]):  # --host needs --profile; no trace
        with pytest.raises(SystemExit):
            bench_trainer.main([*args, *bad])
    assert bench_trainer.main([*args, "--profile", str(prof), "--profile-steps", "2", "--host"]) == 0
    assert not list(tmp_path.rglob("*.jsonl"))
    for run in ("stock", "ours"):
        s = json.loads((prof / f"trainer-qwen3-0.6b-tiny-64-{run}.summary.json").read_text())
        assert s["steps"] == 2 and 0 < s["host_ms_per_step_profiled"] and 0 < s["wall_ms_per_step_profiled"], s
        text = (prof / f"trainer-qwen3-0.6b-tiny-64-{run}.host.txt").read_text()
        # the profiled steps hold Trainer's own step (its training_step), and only the two asked for
        assert "ms per step over 2 step(s)" in text and "training_step" in text, text[:500]
        stats = pstats.Stats(str(prof / f"trainer-qwen3-0.6b-tiny-64-{run}.host.txt.pstats")).stats
        calls = [v[1] for (f, _, fn), v in stats.items() if fn == "training_step" and f.endswith("transformers/trainer.py")]
        assert calls == [2], calls
    assert "rows not stored" in capsys.readouterr().out


def test_each_trainer_peer_also_runs_without_checkpointing_and_trains_the_same_model(tmp_path):
    from harness.bench import trainer as bench_trainer
    from harness.report.user import trainer_tables

    rows = bench_trainer.run("qwen3-0.6b-tiny", ["stock", "ours", "stock-nockpt"], max_length=64, doc_len=32,
                             lora_rank=4, steps=3, warmup=1, device="cpu", attn_implementation="sdpa",
                             experts_implementation=None)
    by = {r["mode"]: r for r in rows}
    assert {m: r["status"] for m, r in by.items()} == {"stock": "ok", "ours": "ok", "stock-nockpt": "ok"}
    # checkpointing is what the row says it ran with: on for stock (and ours), off for the -nockpt peer
    assert (by["stock"]["gradient_checkpointing"], by["stock-nockpt"]["gradient_checkpointing"]) == (True, False)
    assert by["ours"]["gradient_checkpointing"] is True
    assert by["stock-nockpt"]["max_rel_loss_diff_vs_stock"] < 1e-4  # the same model, the same loss curve
    # the peer without checkpointing is a peer: the fastest peer is the faster of the two stock rows
    for r in rows:
        r.update(gpu_slug="cpu", recorded_at="2026-11-28T00:00:00+00:00")
    faster = min(("stock", "stock-nockpt"), key=lambda m: by[m]["ms"])
    label = {"stock": "stock Trainer + peft |", "stock-nockpt": "stock Trainer + peft, no checkpointing |"}[faster]
    text = trainer_tables(rows)
    assert "| stock Trainer + peft, no checkpointing |" in text
    assert f"fastest peer: {label[:-2]}" in text


def test_a_trainer_profile_that_training_outlives_is_written_with_the_steps_it_holds(tmp_path):
    from harness.workload.trainers import documents, trainer_run

    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(6, 512, 24, 32)]
    profile = {"out_dir": str(tmp_path), "stem": "p", "start": 1, "steps": 5, "summary": {
        "model": "qwen3-0.6b-tiny", "seq_len": 64, "variant": "Trainer ours"}}
    trainer_run("qwen3-0.6b-tiny", ours=True, steps=3, batch_size=2, docs=docs, max_length=64, rows=1,
                out_dir=str(tmp_path / "run"), profile=profile)
    s = json.loads((tmp_path / "p.summary.json").read_text())
    assert s["steps"] == 2 and "training ended after 2 of the 5 asked for" in s["profiled"]
    assert s["phases"]["forward_backward"]["cpu_span_ms"] > 0


def test_the_unsloth_runs_of_a_trainer_bench_share_one_weights_folder_removed_after(monkeypatch):
    from harness.bench import trainer as bench_trainer

    seen = []

    def isolated(cfg, timeout_s=None):
        folder = cfg["weights_dir"]
        seen.append((cfg["name"], folder, folder is not None and Path(folder).is_dir()))
        return {"status": "skipped", "error": "not here"}

    monkeypatch.setattr(bench_trainer, "_isolated", isolated)
    kw = dict(max_length=64, doc_len=32, lora_rank=4, steps=2, warmup=1, device="cpu", attn_implementation="sdpa",
              experts_implementation=None)
    bench_trainer.run("qwen3-0.6b-tiny", ["stock", "unsloth", "unsloth-sft-nockpt"], **kw)
    (_, s, _), (_, a, a_there), (_, b, b_there) = seen
    assert a is not None and a == b == s and a_there and b_there  # one folder for the whole bench
    assert not Path(a).exists()  # removed once the last run is done
    seen.clear()
    bench_trainer.run("qwen3-0.6b-tiny", ["stock", "ours"], **kw)
    assert [f for _, f, _ in seen] == [None, None]  # no Unsloth run: no folder


def test_a_killed_benchs_weights_folder_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from harness.bench import trainer as bench_trainer

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, alive = (tmp_path / f"{bench_trainer.WEIGHTS_PREFIX}{p}-x" for p in (int(done.stdout), os.getpid()))
    for folder in (gone, alive):
        (folder / "m").mkdir(parents=True)
    other = tmp_path / "packbench-weights-notapid"
    other.mkdir()
    bench_trainer._drop_stale_weights(str(tmp_path))
    assert not gone.exists() and alive.is_dir() and other.is_dir()


def test_the_unsloth_trainer_run_imports_it_before_torch_and_on_cpu_is_a_skipped_row(unsloth_stand_in):
    # Unsloth patches transformers and peft at import: the run's process must import it first
    from harness.bench import trainer as bench_trainer
    from harness.report.user import trainer_tables

    if torch.cuda.is_available():
        pytest.skip("on a GPU the unsloth run trains; the device's Trainer bench measures it")
    rows = bench_trainer.run("qwen3-0.6b-tiny", ["stock", "unsloth", "unsloth-sft", "unsloth-nockpt"], max_length=64,
                             doc_len=32, lora_rank=4, steps=2, warmup=1, device="cpu", attn_implementation="sdpa",
                             experts_implementation=None)
    # each Unsloth run's process imported it first; stock's never imported it
    assert unsloth_stand_in.read_text() == "|1\n" * 3, "unsloth was imported after " + unsloth_stand_in.read_text()
    by = {r["mode"]: r for r in rows}
    assert by["stock"]["status"] == "ok" and by["stock"]["attn_implementation_used"] == "sdpa"
    for mode in ("unsloth", "unsloth-sft", "unsloth-nockpt"):
        assert by[mode]["status"] == "skipped" and "Unsloth needs a CUDA GPU" in by[mode]["error"], by[mode]
    for r in rows:
        r.update(gpu_slug="cpu", recorded_at="2026-11-28T00:00:00+00:00")
    text = trainer_tables(rows)
    assert "| Trainer on Unsloth's FastLanguageModel | skipped: Unsloth needs a CUDA GPU" in text
    assert "| Unsloth's SFTTrainer | skipped: Unsloth needs a CUDA GPU" in text
    assert "fastest peer: stock Trainer + peft (of stock Trainer + peft only)" in text
