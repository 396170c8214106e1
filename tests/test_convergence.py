"""Convergence on real text (harness.bench.convergence): the corpus, the packing, each stack in its
own process, and the report's checks."""

from __future__ import annotations

import json

import pytest

from harness.bench import convergence as conv


def _stdlib(tmp_path):
    root = tmp_path / "lib"
    for i in range(45):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 1))
    (root / "site-packages" / "other").mkdir(parents=True)
    (root / "site-packages" / "other" / "x.py").write_text("import this\n")
    (root / "empty.py").write_text("\n")
    return root


def test_the_corpus_is_the_stdlib_source_in_sorted_order_with_every_twentieth_file_held_out(tmp_path):
    root = _stdlib(tmp_path)
    train, held, info = conv.corpus(10**9, root)
    assert len(train) + len(held) == 45 and len(held) == 3  # site-packages and the empty file left out
    assert all(d[-1] == conv.EOS and max(d[:-1]) < 256 for d in train + held)
    assert bytes(held[0][:-1]).decode().startswith("def f0(x):")  # files in sorted order: pkg0/m00.py first
    assert info["files"] == 45 and info["held_out_every"] == conv.HELD_OUT_EVERY
    assert conv.corpus(10**9, root)[2]["sha256"] == info["sha256"]  # the same files, the same corpus
    small = conv.corpus(600, root)[2]
    assert small["bytes"] <= 600 and small["sha256"] != info["sha256"]
    (root / "pkg0" / "m00.py").unlink()
    with pytest.raises(RuntimeError, match="too few to train on"):
        conv.corpus(30, root)


def test_a_packed_row_keeps_each_document_apart_as_stock_transformers_packs_it():
    docs = [[10, 11, 12, conv.EOS], [20, 21, conv.EOS], list(range(30, 40)) + [conv.EOS]]
    rows = conv.pack(docs, seq_len=8, rows=3)
    assert len(rows) == 3
    first = rows[0]
    assert first["input_ids"].tolist() == [[10, 11, 12, conv.EOS, 20, 21, conv.EOS]]
    assert first["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]  # restarts at each document
    assert first["labels"].tolist() == [[-100, 11, 12, conv.EOS, -100, 21, conv.EOS]]  # no document predicts the next's first token
    assert all(r["input_ids"].shape[1] <= 8 for r in rows)  # a longer document is cut to the row
    assert rows[1]["input_ids"].tolist() == [list(range(30, 38))]


def test_each_stack_trains_in_its_own_process_and_the_one_call_follows_stocks_curve(tmp_path, capsys):
    assert conv.main(["--results", str(tmp_path), "--model", "qwen3-0.6b-tiny", "--steps", "12", "--seq-len", "128",
                      "--eval-every", "6", "--eval-rows", "1", "--corpus-mib", "0.5"]) == 0
    rows = {r["mode"]: r for r in map(json.loads, (tmp_path / "convergence" / "cpu.jsonl").read_text().splitlines())}
    assert set(rows) == {"stock", "stock-reseeded", "liger", "unsloth", "user"}
    assert rows["liger"]["status"] == "skipped" and "CUDA" in rows["liger"]["message"]
    assert rows["unsloth"]["status"] == "skipped" and "Unsloth needs a CUDA GPU" in rows["unsloth"]["message"]
    stock, user = rows["stock"], rows["user"]
    assert stock["status"] == user["status"] == "ok" and len(stock["losses"]) == 12
    assert [s for s, _ in stock["held_out"]] == [0, 6, 12]
    assert stock["losses"][0] == pytest.approx(stock["ln_vocab"], rel=0.05)  # random init: about ln V
    assert stock["final_held_out"] < stock["held_out"][0][1]  # it learns
    assert user["rel_gap_first_step"] < 1e-4 and user["max_rel_gap_curve"] < 0.01  # fp32: the same model
    assert user["optim"] and user["command"].startswith("python -m harness.bench.convergence")
    # the floor: the same base, adapters from another seed; lora_B starts at zero, so the first
    # step is stock's to the bit, and the curves part only after the adapters have trained
    floor = rows["stock-reseeded"]
    assert floor["rel_gap_first_step"] == 0.0 and floor["max_rel_gap_curve"] > 1e-6
    assert "stored 5 rows" in capsys.readouterr().out


def test_a_rows_document_lengths_are_read_from_its_position_ids():
    import torch

    rows = conv.pack([[10, 11, 12, conv.EOS], [20, 21, conv.EOS], [5, 6, 7, 8, 9, conv.EOS]], seq_len=9, rows=2)
    assert conv.segment_lengths(rows[0]["position_ids"]) == [4, 3]
    assert conv.segment_lengths(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [3, 1, 2]  # a one-token document too
    with pytest.raises(ValueError, match="must restart at 0"):
        conv.segment_lengths(torch.tensor([[1, 2, 0, 1]]))
    inputs = conv._inputs("unsloth", rows[0], "cpu")
    assert inputs["packed_seq_lengths"].dtype == torch.int32 and inputs["packed_seq_lengths"].tolist() == [4, 3]
    assert "packed_seq_lengths" not in conv._inputs("stock", rows[0], "cpu")


def test_unsloth_loads_the_very_weights_stock_trains_from(tmp_path):
    """Its model directory holds the bare model's config and weights (tied ones once): the directory
    Unsloth's loader reads holds stock's base model, not a fresh draw (on a GPU, the first step's
    loss shows the load)."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from harness.run import unsloth_stack
    from harness.workload import models

    spec = dataclasses.replace(models.get("qwen3-0.6b-tiny"), vocab_size=conv.VOCAB, name="tiny-bytes")
    base = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=None, gradient_checkpointing=False, seed=0)
    loaded = AutoModelForCausalLM.from_pretrained(unsloth_stack._model_dir(spec, tmp_path, base))
    theirs = loaded.state_dict()
    assert base.state_dict().keys() == theirs.keys()
    assert all(torch.equal(v, theirs[k]) for k, v in base.state_dict().items())
    assert (tmp_path / "tokenizer.json").is_file()


def _row(mode, losses, held, gaps=None):
    return {"kind": "convergence", "model": "m", "mode": mode, "seq_len": 64, "status": "ok", "vocab_size": 320,
            "ln_vocab": 5.768, "lora_rank": 64, "lr": 1e-3, "steps": len(losses), "losses": losses,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]), "held_out": held, "final_held_out": held[-1][1],
            "ms": 10.0, "ms_p20": 9.0, "ms_p80": 11.0, "gpu_slug": "gpu-x",
            "corpus": {"files": 3, "bytes": 100, "python": "3.12.3", "sha256": "ab", "held_out_every": 20}, **(gaps or {})}


def test_the_report_states_its_checks_and_says_which_a_stack_misses(tmp_path):
    from harness.report import convergence as report

    rows = [_row("stock", [5.7, 3.0, 2.0], [[0, 5.7], [3, 2.5]]),
            _row("user", [5.7, 3.1, 2.1], [[0, 5.7], [3, 2.6]],
                 {"max_rel_gap_curve": 0.021, "max_rel_gap_held_out": 0.04, "rel_gap_first_step": 0.0}),
            _row("liger", [5.7, 5.6, 5.5], [[0, 5.7], [3, 5.5]],
                 {"max_rel_gap_curve": 0.9, "max_rel_gap_held_out": 1.2, "rel_gap_first_step": 0.0})]
    text = report.bench_tables(rows, {}, out_dir=tmp_path)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "held-out < 0.7·ln V: yes; curve gap ≤ 3%: yes; held-out gap ≤ 2%: no" in lines["optim.enable() defaults"]
    assert "held-out < 0.7·ln V: no" in lines["Liger-Kernel"]  # learned nothing: 5.5 of ln V 5.768
    assert "2.10%" in lines["optim.enable() defaults"] and "4.00%" in lines["optim.enable() defaults"]
    assert (tmp_path / "convergence-gpu-x-m-64.png").is_file() and "convergence-gpu-x-m-64.png" in text
    assert report.bench_tables([r for r in rows if r["mode"] == "x"], {}) == ""


def test_a_stack_whose_process_fails_leaves_an_error_row_with_its_reason_and_the_bench_exits_non_zero(tmp_path, capsys):
    assert conv.main(["--results", str(tmp_path), "--model", "no-such-model", "--stacks", "stock", "--steps", "2",
                      "--seq-len", "64", "--corpus-mib", "0.2"]) == 1
    (row,) = map(json.loads, (tmp_path / "convergence" / "cpu.jsonl").read_text().splitlines())
    assert row["status"] == "error" and "exited with 1" in row["message"] and "no-such-model" in row["message"]
    assert "stock did not train" in capsys.readouterr().err


def test_a_gap_that_is_not_a_number_fails_its_check():
    from harness.report import convergence as report

    r = _row("user", [5.7, 3.1], [[0, 5.7], [2, 2.6]],
             {"max_rel_gap_curve": float("nan"), "max_rel_gap_held_out": 0.01, "rel_gap_first_step": 0.0})
    checks = dict(report._checks(r))
    assert checks["curve gap ≤ 3%"] is False and checks["held-out gap ≤ 2%"] is True
    assert dict(report._checks({**r, "max_rel_gap_curve": None}))["curve gap ≤ 3%"] is None  # not judged


def test_a_bench_step_whose_rows_are_errors_is_not_done():
    from harness import reproduce
    from harness.report.blog import plan

    step = plan.Step("convergence", bench="convergence", experiment="convergence")
    ok = {"kind": "convergence", "model": "m", "seq_len": 64, "mode": "stock", "status": "ok"}
    assert reproduce._covered(step, [ok])
    assert not reproduce._covered(step, [{**ok, "status": "error"}])  # the next call runs it again


def test_the_checks_are_targets_in_the_blog_met_or_not():
    from harness.report import convergence as report

    rows = [_row("stock", [5.7, 3.0, 2.0], [[0, 5.7], [3, 2.5]]),
            _row("user", [5.7, 3.1, 2.1], [[0, 5.7], [3, 2.6]],
                 {"max_rel_gap_curve": 0.055, "max_rel_gap_held_out": 0.01, "rel_gap_first_step": 0.0})]
    lines = [line for line in report.targets_md(rows).splitlines() if line.startswith("| optim.enable")]
    assert lines[1] == "| optim.enable() defaults: curve gap ≤ 3% (m, gpu-x, path order) | 5.50% | no |"
    assert lines[2] == "| optim.enable() defaults: held-out gap ≤ 2% (m, gpu-x, path order) | 1.00% | yes |"
    assert report.targets_md([{**rows[0], "status": "error"}]) == ""


def test_a_shuffle_seed_reorders_the_training_documents_alike_every_time_and_the_report_says_so(tmp_path):
    from harness.report import convergence as report

    root = _stdlib(tmp_path)
    plain, held, info = conv.corpus(10**9, root)
    a, held_a, info_a = conv.corpus(10**9, root, shuffle_seed=3)
    assert sorted(map(tuple, a)) == sorted(map(tuple, plain)) and a != plain and held_a == held  # held-out untouched
    assert conv.corpus(10**9, root, shuffle_seed=3)[0] == a and info_a["shuffle_seed"] == 3 and info["shuffle_seed"] is None
    rows = [_row("stock", [5.7, 3.0], [[0, 5.7], [2, 2.5]])]
    assert "sorted path order, not shuffled" in report.bench_tables(rows, {})
    rows[0]["corpus"] = {**rows[0]["corpus"], "shuffle_seed": 3}
    assert "shuffled with seed 3" in report.bench_tables(rows, {})


def test_runs_in_another_document_order_are_tables_of_their_own_and_the_floor_is_said_not_judged():
    from harness.report import convergence as report

    def at(row, seed, when):
        return {**row, "corpus": {**row["corpus"], "shuffle_seed": seed}, "recorded_at": when}

    losses, held = [5.0, 4.0, 3.0], [[0, 5.0], [3, 3.0]]
    gap = {"max_rel_gap_curve": 0.04, "max_rel_gap_held_out": 0.01, "rel_gap_first_step": 0.0}
    rows = [at(_row("stock", losses, held), None, "2026-01-01"), at(_row("user", losses, held, gap), None, "2026-01-01"),
            at(_row("stock", losses, held), 0, "2026-01-02"), at(_row("user", losses, held, gap), 0, "2026-01-02"),
            at(_row("stock-reseeded", losses, held, {**gap, "max_rel_gap_curve": 0.06}), 0, "2026-01-02")]
    md = report.bench_tables(rows, {})
    assert md.count("| stock transformers + peft |") == 2 and md.count("| optim.enable() defaults |") == 2  # one table per order
    assert "sorted path order, not shuffled" in md and "shuffled with seed 0" in md
    assert "part by 6.00% on the curve and 1.00% held-out" in md
    floor_line = next(line for line in md.splitlines() if line.startswith("| stock, adapters from another seed"))
    assert "curve gap ≤" not in floor_line  # the yardstick is not judged against stock
    targets = report.targets_md(rows)
    assert "(m, gpu-x, shuffled, seed 0)" in targets and "(m, gpu-x, path order)" in targets
    assert "adapters from another seed (the floor): curve gap" not in targets


def test_over_several_adapter_seeds_each_stack_runs_per_seed_and_is_judged_on_its_mean(tmp_path, capsys):
    from harness.report import convergence as report

    assert conv.main(["--results", str(tmp_path), "--model", "qwen3-0.6b-tiny", "--steps", "6", "--seq-len", "128",
                      "--eval-every", "3", "--eval-rows", "1", "--corpus-mib", "0.3", "--stacks", "stock", "user",
                      "--adapter-seeds", "1", "2"]) == 0
    rows = list(map(json.loads, (tmp_path / "convergence" / "cpu.jsonl").read_text().splitlines()))
    assert sorted((r["mode"], r["adapter_seed"]) for r in rows) == [("stock", 1), ("stock", 2), ("user", 1), ("user", 2)]
    stock = {r["adapter_seed"]: r for r in rows if r["mode"] == "stock"}
    assert stock[1]["losses"][0] == stock[2]["losses"][0]  # lora_B starts at zero: the seeds part after step 1
    assert stock[1]["losses"] != stock[2]["losses"]  # the seed reached the adapters
    assert all("max_rel_gap_curve" in r for r in rows if r["mode"] == "user")  # each against stock of its seed
    (group,) = report.runs(rows).values()
    checks = {m: (held, gap, ok) for m, held, gap, ok in report.seed_checks(group)}
    assert checks["stock"][1] is None and checks["user"][2] is True  # fp32 on the CPU: the same model
    assert "over 2 adapter seeds within 1% of stock's" in report.targets_md(rows)
    assert "stored 4 rows" in capsys.readouterr().out


def test_the_floor_stack_beside_adapter_seeds_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        conv.main(["--results", str(tmp_path), "--stacks", "stock", "stock-reseeded", "--adapter-seeds", "1", "2"])
    assert e.value.code == 2 and "the seeds are the floor" in capsys.readouterr().err
    assert not (tmp_path / "convergence").exists()  # nothing trained, nothing stored


def test_the_learning_rate_follows_trainers_linear_schedule():
    import torch
    from transformers import get_linear_schedule_with_warmup

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, out = make(opt), []
        for _ in range(10):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert lrs(lambda o: conv.scheduler(o, "linear", 3, 10)) == lrs(lambda o: get_linear_schedule_with_warmup(o, 3, 10))
    assert lrs(lambda o: conv.scheduler(o, "linear", 3, 10))[:4] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert lrs(lambda o: conv.scheduler(o, "constant", 0, 10)) == [1.0] * 10
    assert conv.warmup_steps("linear", 0.1, 300) == 30 and conv.warmup_steps("linear", 0.1, 25) == 3  # rounded up
    assert conv.warmup_steps("constant", 0.1, 300) == 0


def test_importing_the_bench_leaves_torch_unimported_so_unsloth_can_come_first():
    import subprocess
    import sys

    code = ("import sys, harness.bench, harness.bench.convergence, harness.run.unsloth_stack; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unsloth_is_refused_past_the_models_positions_where_it_would_rescale_rope():
    import torch

    from harness.run import peers, unsloth_stack
    from harness.workload import models

    spec = models.get("qwen3-0.6b")
    cfg = spec.config()
    assert unsloth_stack.rope(cfg) == {"rope_type": "default", "factor": None, "rope_theta": cfg.rope_parameters["rope_theta"]}
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "linear", "factor": 1.6}  # what Unsloth's load set
    assert unsloth_stack.rope(cfg) != unsloth_stack.rope(spec.config())
    unsloth_stack.import_first()
    if "unsloth" in __import__("sys").modules:  # pragma: no cover - the refusal below is checked where it is not
        pytest.skip("unsloth is importable here: the GPU test covers its load")
    with pytest.raises(peers.PeerUnavailable, match="needs a CUDA GPU"):
        unsloth_stack.check(spec, device=torch.device("cpu"), lora_rank=16, max_seq_length=65536)
    __import__("sys").modules["unsloth"] = object()  # as if imported first on a GPU machine
    try:
        with pytest.raises(peers.PeerUnavailable, match="past qwen3-0.6b's 40960 positions"):
            unsloth_stack.check(spec, device=torch.device("cuda"), lora_rank=16, max_seq_length=65536)
        unsloth_stack.check(spec, device=torch.device("cuda"), lora_rank=16, max_seq_length=40960)  # within: fine
        # llama3 RoPE (Llama 3.1) Unsloth keeps past the window, only widening it: the same model runs
        llama = models.get("llama-3.1-8b")
        assert unsloth_stack.rope(llama.config())["rope_type"] == "llama3"
        unsloth_stack.check(llama, device=torch.device("cuda"), lora_rank=16, max_seq_length=262144)
        with pytest.raises(peers.PeerUnavailable, match="past qwen3-8b-yarn's 131072 positions"):
            unsloth_stack.check(models.get("qwen3-8b-yarn"), device=torch.device("cuda"), lora_rank=16,
                                max_seq_length=262144)
    finally:
        del __import__("sys").modules["unsloth"]


def test_a_run_records_its_schedule_and_clipped_norms_and_never_shares_a_table_or_plot_with_another(tmp_path):
    from harness.report import convergence as report

    assert conv.main(["--results", str(tmp_path), "--model", "qwen3-0.6b-tiny", "--steps", "5", "--seq-len", "96",
                      "--eval-every", "5", "--eval-rows", "1", "--corpus-mib", "0.2", "--stacks", "stock",
                      "--max-grad-norm", "0.5"]) == 0
    (row,) = map(json.loads, (tmp_path / "convergence" / "cpu.jsonl").read_text().splitlines())
    assert (row["schedule"], row["warmup_steps"], row["max_grad_norm"], row["weight_decay"]) == ("linear", 1, 0.5, 0.0)
    assert len(row["grad_norms"]) == 5 and all(g > 0 for g in row["grad_norms"])  # the norm before clipping
    assert row["lrs"] == pytest.approx([0.0, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])  # the rate each step ran at
    old = {k: v for k, v in row.items() if k not in ("schedule", "warmup_steps", "max_grad_norm", "grad_norms", "weight_decay")}
    groups = report.runs([row, old])
    assert len(groups) == 2  # a run at a constant rate (rows before schedules) is another run
    out = tmp_path / "rep"
    out.mkdir()
    md = report.bench_tables([row, old], {}, out)
    assert "(linear decay after 1 warm-up steps, gradients clipped to norm 0.5, weight decay 0.0)" in md
    assert "(constant, no clipping, weight decay 0.01)" in md
    assert len(list(out.glob("*.png"))) == 2  # one plot each, neither drawn over the other
    with pytest.raises(SystemExit):
        conv.main(["--results", str(tmp_path), "--warmup-frac", "1.5"])
