"""optim.collector: the cycle collector's young threshold raised while a model is enabled, only
ever raised, put back by the last model to let go; and in a real training loop, the collections
it keeps out of a step."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

import optim
import optim.collector as C
from harness.workload import models

RAISE = 100000  # the value the docs give for turning the switch on


@pytest.fixture(autouse=True)
def _collector_as_found():
    """CPython's usual thresholds, and no model of an earlier test holding a raise (their holds set
    aside, and put back after); a hold this test's models leave is detached, not leaked."""
    before, on = gc.get_threshold(), gc.isenabled()
    others, found, set_ = dict(C._held), C._found, C._set
    C._held.clear()
    C._found = C._set = None
    gc.set_threshold(700, 10, 10)
    yield
    for fin, _ in C._held.values():
        fin.detach()
    C._held.clear()
    C._held.update(others)
    C._found, C._set = found, set_
    gc.set_threshold(*before)
    (gc.enable if on else gc.disable)()


def _base():
    return gc.get_threshold()  # as the fixture set it, as this interpreter reads it back


def _raised(young):
    return (young, *_base()[1:])


def _model(name="qwen3-0.6b-tiny"):
    return models.build(models.get(name), device="cpu", dtype=torch.float32, lora_rank=4)


def test_enable_raises_the_young_threshold_and_disable_puts_it_back():
    base, m = _base(), _model()
    optim.enable(m, only=("collector",), gc_threshold=RAISE)
    assert gc.get_threshold() == _raised(RAISE)
    d = optim.enabled(m)["optim.collector"]
    assert d["gc_threshold"] == RAISE and f"raised from {base}" in d["collector"]
    optim.enable(m, only=("collector",), gc_threshold=20000)  # a second enable replaces the first's request
    assert gc.get_threshold() == _raised(20000)
    optim.disable(m)
    assert gc.get_threshold() == base and not C._held


def test_the_switch_off_its_default_and_its_environment_variable_leave_the_collector(monkeypatch):
    base, m = _base(), _model()
    monkeypatch.delenv("OPTIM_GC_THRESHOLD", raising=False)
    optim.enable(m)  # off by default: compiled layers make few objects, and the raise measured no gain
    assert gc.get_threshold() == base and not C._held
    optim.enable(m, only=("collector",), gc_threshold="off")
    assert gc.get_threshold() == base
    assert "gc_threshold=off" in optim.enabled(m)["optim.collector"]["collector"]
    monkeypatch.setenv("OPTIM_GC_THRESHOLD", "off")
    optim.enable(m, only=("collector",))
    assert gc.get_threshold() == base
    monkeypatch.setenv("OPTIM_GC_THRESHOLD", "20000")
    optim.enable(m, only=("collector",))
    assert gc.get_threshold() == _raised(20000)
    with pytest.raises(ValueError, match="gc_threshold=12345"):
        optim.enable(m, gc_threshold=12345)


def test_a_larger_threshold_or_a_disabled_collector_is_the_process_own():
    m = _model()
    gc.set_threshold(10 * RAISE, 5, 5)
    mine = gc.get_threshold()
    optim.enable(m, only=("collector",), gc_threshold=RAISE)
    assert gc.get_threshold() == mine
    assert "left as they are" in optim.enabled(m)["optim.collector"]["collector"]
    optim.disable(m)
    assert gc.get_threshold() == mine
    for off in ("disable", "threshold 0"):
        gc.set_threshold(700, 10, 10)
        if off == "disable":
            gc.disable()
        else:
            gc.set_threshold(0)  # automatic collection off, though gc.isenabled() stays True
        was = gc.get_threshold()
        optim.enable(m, only=("collector",), gc_threshold=RAISE)
        assert gc.get_threshold() == was and gc.isenabled() == (off != "disable"), off
        assert "disabled by the process" in optim.enabled(m)["optim.collector"]["collector"]
        optim.disable(m)
        gc.enable()


def test_the_last_of_two_models_puts_it_back_and_a_setting_made_since_stays():
    base, a, b = _base(), _model(), _model("gpt-oss-20b-tiny")
    optim.enable(a, only=("collector",), gc_threshold=RAISE)
    optim.enable(optim.owner(b), only=("collector",), gc_threshold=2 * RAISE)  # the base model, not its peft wrapper
    assert gc.get_threshold() == _raised(2 * RAISE)  # the larger request holds
    optim.disable(b)  # through the wrapper: the same model
    assert gc.get_threshold() == _raised(RAISE)  # a's own request
    optim.disable(a)
    assert gc.get_threshold() == base
    optim.enable(a, only=("collector",), gc_threshold=RAISE)
    gc.set_threshold(RAISE, 50, 50)  # the process changes the older generations while a holds
    mine = gc.get_threshold()
    optim.enable(b, only=("collector",), gc_threshold=RAISE)
    gc.set_threshold(5000, 10, 10)  # and then the young one
    optim.disable(b)
    optim.disable(a)
    assert gc.get_threshold() == (5000, *base[1:])  # its last setting stays, never one from before it
    assert mine != gc.get_threshold()


def test_a_model_collected_without_disable_lets_go_and_a_deep_copy_holds_nothing_of_its_own():
    base, m = _base(), _model()
    optim.enable(m, only=("collector",), gc_threshold=RAISE)
    copy_ = copy.deepcopy(m)
    assert "holds no raise" in optim.enabled(copy_)["optim.collector"]["collector"]
    del m
    gc.collect()
    assert gc.get_threshold() == base and not C._held
    optim.enable(copy_, only=("collector",), gc_threshold=RAISE)  # the copy, enabled, holds it like any model
    assert gc.get_threshold() == _raised(RAISE)
    del copy_
    gc.collect()
    assert gc.get_threshold() == base


def _collections_per_step(gc_threshold, steps=4):
    """Young and full collections in each step of a real training loop after the first: a
    gpt-oss-shaped model (8 layers, 32 experts, top 4) with checkpointing, LoRA, optim.enable."""
    tiny = models.get("gpt-oss-20b-tiny")
    extra = dict(tiny.extra, num_local_experts=32, num_experts_per_tok=4,
                 layer_types=["sliding_attention", "full_attention"] * 4)
    spec = dataclasses.replace(tiny, num_hidden_layers=8, extra=extra)
    torch.manual_seed(0)
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=True)
    optim.enable(model, gc_threshold=gc_threshold)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    meta = optim.packing.PackedMetadata.from_lengths([[96, 160]])
    ids = torch.randint(0, spec.vocab_size, (1, 256))
    pos = meta.position_ids()
    kw = optim.packing.packed_kwargs(meta)
    seen = []
    cb = lambda phase, info: seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(cb)
    try:
        per_step = []
        for i in range(steps + 1):
            seen.clear()
            loss = model(input_ids=ids, labels=ids.masked_fill(pos == 0, -100), position_ids=pos,
                         use_cache=False, **kw).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:
                per_step.append([seen.count(g) for g in range(3)])
    finally:
        gc.callbacks.remove(cb)
        optim.disable(model)
    return per_step


def test_a_training_step_runs_without_collections_where_the_collector_would_run_dozens(one_thread):
    base = _base()
    stock = _collections_per_step("off")
    ours = _collections_per_step(RAISE)
    assert gc.get_threshold() == base
    assert all(young >= 10 for young, _, _ in stock), stock  # the loop this measures does collect
    assert all(young <= 1 and full == 0 for young, _, full in ours), ours
