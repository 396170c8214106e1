"""optim.enable in transformers.Trainer and TRL's SFTTrainer, for real: the same losses as the
stock run step by step, and the packing metadata taken from what each collator hands over."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.workload.trainers import documents, sft_run, trainer_run

pytestmark = pytest.mark.slow
MODEL = "qwen3-0.6b-tiny"


def _close_curves(ours: list[float], stock: list[float], rtol: float) -> None:
    assert len(ours) == len(stock) > 0
    for i, (a, b) in enumerate(zip(ours, stock)):
        assert abs(a - b) <= rtol * abs(b), (i, a, b)


@pytest.mark.parametrize("mode", ["padding_free", "packing"])
def test_sft_trainer_with_peft_config_then_enable_matches_stock(tmp_path, mode):
    pytest.importorskip("trl")
    docs = documents(48, 512, 5, 60)
    kw = dict(mode=mode, steps=4, batch_size=4, docs=docs, max_length=128)
    stock = sft_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = sft_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _close_curves(ours["losses"], stock["losses"], 1e-4)
    assert set(ours["enabled"]) >= {"optim.packing", "optim.loss"}
    # both hand cu_seq_lens_q/max_length_q (BFD packing is padding-free too): no position_ids read
    c = ours["counters"]
    assert c["from_cu_seqlens"] == c["metadata"] == 4 and "position_id_reads" not in c, c


def test_trainer_with_the_packing_collator_matches_stock_flattening(tmp_path):
    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(48, 512, 5, 30)]
    kw = dict(steps=4, batch_size=4, docs=docs, max_length=128)
    stock = trainer_run(MODEL, ours=False, out_dir=str(tmp_path / "s"), **kw)
    ours = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "o"), **kw)
    _close_curves(ours["losses"], stock["losses"], 1e-4)
    c = ours["counters"]
    assert c["metadata"] == 4 and "position_id_reads" not in c, c  # the collator's host lengths
    assert torch.isfinite(torch.tensor(ours["losses"])).all()


def test_trainer_launched_by_torchrun_trains_the_enabled_model_in_ddp_as_stock(tmp_path):
    # the way out optim's DataParallel refusal names: one process per device. Two ranks on CPU
    # (gloo), Trainer's DistributedDataParallel around the enabled model, each rank its own batches
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    got = {}
    for side in ("stock", "ours"):
        # its own session: on a timeout the launcher's workers are killed with it, not left behind
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 str(root / "tests" / "_ddp_trainer.py"), side, str(tmp_path / side),
                                 str(tmp_path / f"{side}.json")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, out[-6000:]
        got[side] = json.loads((tmp_path / f"{side}.json").read_text())
    assert got["ours"]["world_size"] == got["stock"]["world_size"] == 2
    assert got["ours"]["wrapped"] == "DistributedDataParallel"
    assert {"optim.packing", "optim.loss"} <= set(got["ours"]["enabled"])
    _close_curves(got["ours"]["losses"], got["stock"]["losses"], 1e-4)
    for side in ("stock", "ours"):  # each step's loss read from the device is the mean over ranks Trainer logs
        _close_curves(got[side]["losses"], got[side]["logged_losses"], 1e-3)


def test_trainer_step_losses_are_the_logged_ones_without_a_log_every_step(tmp_path):
    # the bench reads each optimizer step's loss without Trainer logging (and syncing) every step:
    # the sum of the step's micro-step losses, which is what Trainer logs when it logs each step
    docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(32, 512, 5, 30)]
    kw = dict(steps=4, batch_size=2, docs=docs, max_length=128, accumulation=2)
    every = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "e"), logging_steps=1, **kw)
    quiet = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "q"), **kw)
    assert every["logging_steps"] == 1 and quiet["logging_steps"] == 500
    assert len(every["logged_losses"]) == 4 and quiet["logged_losses"] == []
    _close_curves(every["losses"], every["logged_losses"], 1e-3)  # Trainer rounds what it logs
    assert len(set(every["losses"])) == 4  # four steps, four losses: not one step's repeated
    _close_curves(quiet["losses"], every["losses"], 1e-6)
    # more TrainingArguments reach Trainer; those trainer_run sets itself are refused
    off = trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "f"), trainer_args={"logging_nan_inf_filter": False}, **kw)
    assert off["trainer_args"] == {"logging_nan_inf_filter": False}
    _close_curves(off["losses"], every["losses"], 1e-6)
    with pytest.raises(ValueError, match="logging_steps"):
        trainer_run(MODEL, ours=True, out_dir=str(tmp_path / "x"), trainer_args={"logging_steps": 5}, **kw)


def test_unsloths_collator_is_the_stock_flattened_row_plus_each_documents_length():
    from transformers import DataCollatorWithFlattening

    from harness.workload.trainers import UnslothFlattening

    feats = [{"input_ids": list(range(2, 2 + n)), "labels": list(range(2, 2 + n))} for n in (5, 3, 7)]
    got, want = UnslothFlattening()(feats), DataCollatorWithFlattening(return_position_ids=True)(feats)
    assert set(got) == set(want) | {"packed_seq_lengths"}
    for k in want:
        assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), k
    lengths = got["packed_seq_lengths"]
    assert lengths.dtype == torch.int32 and lengths.device.type == "cpu" and lengths.tolist() == [5, 3, 7]


def _unsloth_loader_stand_in(monkeypatch, tmp_path):
    """Unsloth itself needs a GPU: its loader stands aside for transformers' own, reading the model
    directory the harness writes for Unsloth (``base`` saved there, as Unsloth would read it), with
    peft's adapters on the harness's modules, drawn after reseeding as Unsloth's ``get_peft_model``
    (``random_state``) does. Every bare model built for it must be gone before it loads (the card
    would hold two copies). Returns the ``base`` each build was given."""
    import weakref

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from harness.run import unsloth_stack
    from harness.workload import models

    given, bare, real_build = [], [], models.build

    def tracked_build(*a, **k):
        m = real_build(*a, **k)
        if k.get("lora_rank", 16) is None:
            bare.append(weakref.ref(m))
        return m

    def build(spec, *, device, dtype, lora_rank, max_seq_length, gradient_checkpointing, seed, base=None):
        given.append(base)
        root = tmp_path / f"unsloth-dir-{len(given)}"
        root.mkdir()
        directory = unsloth_stack.loader_dir(spec, root, base)
        assert all(r() is None for r in bare), "stock's weights are still held while Unsloth loads"
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        torch.manual_seed(seed)
        return get_peft_model(model, models.lora_config(spec, lora_rank)).train()

    monkeypatch.setattr(models, "build", tracked_build)
    monkeypatch.setattr(unsloth_stack, "check", lambda *a, **k: None)
    monkeypatch.setattr(unsloth_stack, "build", build)
    return given


def test_unsloth_under_trainer_trains_stocks_base_weights(tmp_path, monkeypatch):
    """The Trainer bench's Unsloth run loads the base weights stock trains (the loader's model
    directory holds them): its first step, before the adapters (lora_B at zero) move, is stock's
    model, and the later steps part only by the adapters' draw. Without room on the disk Unsloth
    draws its own weights, and the row says so."""
    from harness.run import unsloth_stack

    given = _unsloth_loader_stand_in(monkeypatch, tmp_path)
    docs = documents(12, 512, 20, 40)
    kw = dict(ours=False, steps=3, batch_size=4, docs=docs, max_length=160, lora_rank=4)
    theirs = trainer_run(MODEL, peer="unsloth", out_dir=str(tmp_path / "u"), **kw)
    stock = trainer_run(MODEL, out_dir=str(tmp_path / "s"), **kw)
    assert len(given) == 1 and callable(given[0]) and theirs["weights"] == stock["weights"] == "stock"
    _close_curves(theirs["losses"][:1], stock["losses"][:1], 1e-6)
    _close_curves(theirs["losses"], stock["losses"], 1e-3)

    monkeypatch.setattr(unsloth_stack, "no_room_for_weights", lambda spec, dtype, directory=None: "no room here")
    drawn = trainer_run(MODEL, peer="unsloth", out_dir=str(tmp_path / "d"), **kw)
    assert given[1] is None and drawn["weights"] == "Unsloth's own draw: no room here"
    assert abs(drawn["losses"][0] - stock["losses"][0]) > 1e-6 * stock["losses"][0]  # another model


def test_the_unsloth_runs_of_one_bench_build_and_save_stocks_weights_once(tmp_path, monkeypatch):
    """Given a shared folder, the first Unsloth run builds stock's bare model and saves it there; a
    later run reads that copy without building or saving again, and trains the same model. What a
    run killed while saving left is cleared first, and takes no room from the next save."""
    from harness.workload import models

    given = _unsloth_loader_stand_in(monkeypatch, tmp_path)
    built, real_build = [], models.build
    monkeypatch.setattr(models, "build", lambda *a, **k: built.append(k.get("lora_rank")) or real_build(*a, **k))
    shared = tmp_path / "shared"
    (shared / f".{MODEL}-killed").mkdir(parents=True)  # a save a killed run left halfway
    (shared / f".{MODEL}-killed" / "model.safetensors").write_bytes(b"half")
    docs = documents(12, 512, 20, 40)
    kw = dict(ours=False, steps=2, batch_size=4, docs=docs, max_length=160, lora_rank=4)
    first = trainer_run(MODEL, peer="unsloth", out_dir=str(tmp_path / "u1"), weights_dir=str(shared), **kw)
    assert sorted(p.name for p in shared.iterdir()) == [MODEL]  # in place whole, the half save gone
    assert built.count(None) == 1 and given[0] == shared / MODEL
    second = trainer_run(MODEL, peer="unsloth", out_dir=str(tmp_path / "u2"), weights_dir=str(shared), **kw)
    assert built.count(None) == 1, "the second run built stock's weights again"
    assert given[1] == shared / MODEL and first["weights"] == second["weights"] == "stock"
    stock = trainer_run(MODEL, out_dir=str(tmp_path / "s"), **kw)
    _close_curves(second["losses"][:1], stock["losses"][:1], 1e-6)
    _close_curves(first["losses"], second["losses"], 1e-6)


def test_the_weights_room_is_read_from_the_temporary_directory(tmp_path, monkeypatch):
    import shutil

    from harness.run import unsloth_stack
    from harness.workload import models

    spec = models.get(MODEL)
    assert unsloth_stack.no_room_for_weights(spec, torch.bfloat16, str(tmp_path)) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    why = unsloth_stack.no_room_for_weights(spec, torch.bfloat16, str(tmp_path))
    assert why.startswith(f"{spec.name}'s weights need ") and f"{tmp_path} has 0.0 GiB free" in why


def test_the_weights_built_for_unsloths_loader_are_released_before_it_loads(tmp_path):
    """A function given as ``base`` builds the model, which is saved and let go: the card never
    holds stock's copy beside Unsloth's (two copies of a 20B model fill an 80 GB card). A model
    given as ``base`` is the caller's and is left alone."""
    import weakref

    from harness.run import unsloth_stack
    from harness.workload import models
    from harness.workload.trainers import stock_weights

    spec = models.get(MODEL)
    refs = []

    def build():
        m = stock_weights(spec, device="cpu", dtype=torch.float32)()
        refs.append(weakref.ref(m))
        return m

    (tmp_path / "a").mkdir()
    unsloth_stack._model_dir(spec, tmp_path / "a", build)
    assert len(refs) == 1 and refs[0]() is None, "the built model outlived its save"
    assert (tmp_path / "a" / "model.safetensors").is_file()
    kept = stock_weights(spec, device="cpu", dtype=torch.float32)()
    (tmp_path / "b").mkdir()
    unsloth_stack._model_dir(spec, tmp_path / "b", kept)
    assert next(kept.parameters()).numel() > 0  # still usable by its owner


def test_unsloths_sft_run_trains_what_the_stock_trainer_trains_step_for_step(tmp_path, monkeypatch):
    # Unsloth's loader stands aside (``_unsloth_loader_stand_in``), so the rest of the run (TRL's
    # SFTTrainer, the config kept at Trainer's defaults where Unsloth's differ, one micro-step of
    # the same documents per optimizer step, stock's weights) is checked against stock on CPU
    from transformers import TrainingArguments

    from harness.workload import models
    from harness.workload.trainers import SAME_AS_TRAINER, unsloth_sft_run

    given = _unsloth_loader_stand_in(monkeypatch, tmp_path)
    seen = {}

    from transformers import TrainerCallback

    class Args(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen.update({k: getattr(args, k) for k in (*SAME_AS_TRAINER, "gradient_accumulation_steps")})

    docs = [{**d, "labels": d["input_ids"]} for d in documents(6, models.get("qwen3-0.6b-tiny").vocab_size, 32, 33)]
    profile = {"out_dir": str(tmp_path), "stem": "sft", "start": 1, "steps": 2,  # as the bench's --profile asks
               "summary": {"model": "qwen3-0.6b-tiny", "seq_len": 64, "variant": "Trainer unsloth-sft"}}
    sft = unsloth_sft_run("qwen3-0.6b-tiny", steps=3, batch_size=2, docs=docs, max_length=64, device="cpu",
                          dtype=torch.float32, lora_rank=4, out_dir=str(tmp_path / "sft"), callbacks=[Args()],
                          profile=profile)
    assert json.loads((tmp_path / "sft.summary.json").read_text())["steps"] == 2
    stock = trainer_run("qwen3-0.6b-tiny", ours=False, steps=3, batch_size=2, docs=docs, max_length=64,
                        lora_rank=4, out_dir=str(tmp_path / "stock"))
    fields = TrainingArguments.__dataclass_fields__
    assert {k: str(getattr(v, "value", v)) for k, v in seen.items()} == {
        **{k: str(fields[k].default) for k in SAME_AS_TRAINER},
        "gradient_accumulation_steps": "1"}
    assert sft["batching"] == "padded rows" and sft["gradient_checkpointing"] is False
    assert len(given) == 1 and callable(given[0]) and sft["weights"] == "stock"
    assert len(sft["losses"]) == 3 and sft["losses"] == pytest.approx(stock["losses"], rel=1e-4)
