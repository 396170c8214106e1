"""optim.recompute on CPU: the decision (``plan``) on numbers, and the layer wrappers on a real
model with a stand-in for CUDA's allocator counters: skipped recomputes give plain checkpointing's
loss and gradients at every step, the first included; a layer with no room keeps recomputing; a
later gradient_checkpointing_enable (Trainer's) keeps the decision."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import optim
import optim.recompute as R
from harness.workload import models

GIB = 2**30


pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_skips_the_cheapest_layers_while_they_fit():
    acts = {0: 1 * GIB, 1: 2 * GIB, 2: 1 * GIB}
    # headroom max(1 GiB, 5 % of 80 GiB) = 4 GiB: room 20 - 10 - 4 = 6 GiB holds all three (4 GiB)
    assert R.plan(acts, 10 * GIB, 1000, 1000, 20 * GIB, 80 * GIB) == {0, 1, 2}
    assert R.plan(acts, 10 * GIB, 1000, 1000, 16 * GIB, 80 * GIB) == {0, 2}  # room 2: the two 1 GiB layers
    assert R.plan(acts, 10 * GIB, 1000, 1000, 15 * GIB, 80 * GIB) == {0}
    assert R.plan(acts, 10 * GIB, 1000, 1000, 14 * GIB, 80 * GIB) == set()
    # twice the tokens: twice the growth, four times the activations (a T x T term grows so)
    assert R.plan(acts, 10 * GIB, 2000, 1000, 30 * GIB, 80 * GIB) == {0}
    assert R.plan(acts, 10 * GIB, 2000, 1000, 32 * GIB, 80 * GIB) == {0, 2}
    # fewer tokens: the activations shrink, the growth is never taken below what was measured
    assert R.plan(acts, 10 * GIB, 500, 1000, 16 * GIB, 80 * GIB) == {0, 1, 2}
    assert R.plan(acts, 10 * GIB, 500, 1000, 14 * GIB, 80 * GIB) == set()


class FakeMemory:
    """CUDA's counters for a CPU run: every read of ``allocated`` grows by 256 MiB (so each
    recompute shows 256 MiB of activations), the peak sits 4 reads above it, and the device has
    ``usable`` bytes to give (80 GiB in all: a 4 GiB headroom)."""

    usable = 1000 * GIB

    def __init__(self, device):
        self.n = 0
        self.resets = 0

    def allocated(self) -> int:
        self.n += 1
        return 40 * GIB + self.n * 2**28

    def peak(self) -> int:
        return 40 * GIB + (self.n + 4) * 2**28

    def reset_peak(self) -> None:
        self.resets += 1

    def usable_and_total(self):
        return self.usable, 80 * GIB


class NoRoom(FakeMemory):
    usable = 0


def _model(layers=3):
    spec = dataclasses.replace(models.get("llama-3.2-1b-tiny"), num_hidden_layers=layers)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    models.randomize_lora_b(m)
    return m


def _attention_calls(m) -> list[int]:
    """Calls of each layer's attention: 2 per step where the layer recomputes, 1 where it does not."""
    calls = []
    for layer in R._layers(m):
        calls.append(0)
        i = len(calls) - 1
        layer.self_attn.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _steps(m, n=3, shapes=None):
    shapes = shapes or [(2, 32)] * n
    out, calls = [], _attention_calls(m)
    for i, (b, t) in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 512, (b, t), generator=g)
        for p in m.parameters():
            p.grad = None
        before = list(calls)
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad}
        out.append((loss.detach(), grads, [c - b0 for c, b0 in zip(calls, before)]))
    return out


def test_skipped_recomputes_give_plain_checkpointings_loss_and_gradients_at_every_step():
    plain = _steps(_model())
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    ours = _steps(m)
    for step, ((l0, g0, c0), (l1, g1, c1)) in enumerate(zip(plain, ours)):
        assert torch.equal(l0, l1), step
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0), step
        assert c0 == [2, 2, 2]
    assert [c for _, _, c in ours] == [[2, 2, 2], [1, 1, 1], [1, 1, 1]]  # measured, then no recompute
    d = R.describe(m)
    assert d["layers_skipped"] == {"last": 3, "min": 3, "max": 3} and d["recomputes"] == 3
    assert (d["measured_tokens"], d["activation_gib_per_layer"], d["step_growth_gib"]) == (64, 0.25, 2.5)


def test_no_room_keeps_every_recompute_and_a_longer_batch_is_judged_on_its_tokens():
    m = _model()
    R.enable(m, recompute="auto", _memory=NoRoom)
    assert [c for _, _, c in _steps(m)] == [[2, 2, 2]] * 3
    assert R.describe(m)["layers_skipped"]["max"] == 0

    class Tight(FakeMemory):
        # the measured step: 6 reads in its 3 recomputes, so a growth of 10 reads (2.5 GiB) and
        # 0.25 GiB per layer; room for those beside the 4 GiB headroom, not for four times the tokens
        usable = 4 * GIB + 10 * 2**28 + 3 * 2**28 + 2**26

    m = _model()
    R.enable(m, recompute="auto", _memory=Tight)
    counts = [c for _, _, c in _steps(m, shapes=[(2, 32), (2, 32), (2, 128), (2, 32)])]
    assert counts[1] == [1, 1, 1] and counts[2] == [2, 2, 2] and counts[3] == [1, 1, 1]


def test_a_later_gradient_checkpointing_enable_keeps_the_decision_and_disable_restores():
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    _steps(m, n=1)
    # Trainer turns checkpointing on again at train(): new functions on every layer
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert [c for _, _, c in _steps(m, n=2)] == [[1, 1, 1]] * 2
    R.disable(m)
    assert not any(isinstance(getattr(layer, "_gradient_checkpointing_func", None), R.BudgetedCheckpoint)
                   for layer in R._layers(m))
    assert [c for _, _, c in _steps(m, n=1)] == [[2, 2, 2]]


def test_all_and_cpu_keep_plain_checkpointing_and_enable_reports_it():
    m = _model()
    optim.enable(m, recompute="all")
    assert [c for _, _, c in _steps(m, n=2)] == [[2, 2, 2]] * 2
    m = _model()
    optim.enable(m)  # auto on CPU: nothing to measure the device with, every recompute stays
    assert [c for _, _, c in _steps(m, n=2)] == [[2, 2, 2]] * 2
    assert optim.enabled(m)["optim.recompute"]["resolved"] == {"recompute": "auto"}
    assert R.run_stats(m)["recompute_stats"]["layers_skipped"]["max"] == 0


def test_a_forward_without_backward_is_not_the_measured_step_and_a_reset_peak_measures_again():
    """A first forward with no backward (evaluation with grad on, a log-prob pass) leaves nothing
    measured: the next forward measures on its own tokens. A peak statistic reset during the
    measured step (a logger's reset_peak_memory_stats) is seen, and the step after measures again."""
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # no backward to come: not the module's to decide
        m(input_ids=torch.randint(0, 512, (1, 8), generator=g), use_cache=False)
    m(input_ids=torch.randint(0, 512, (1, 8), generator=g), use_cache=False)  # grad on, no backward
    counts = [c for _, _, c in _steps(m, n=2)]
    assert R.describe(m)["measured_tokens"] == 64 and counts == [[2, 2, 2], [1, 1, 1]]

    class Resetting(FakeMemory):  # the peak reads below what the measured step allocated
        def peak(self) -> int:
            return 0

    m = _model()
    R.enable(m, recompute="auto", _memory=Resetting)
    assert [c for _, _, c in _steps(m, n=4)] == [[2, 2, 2]] * 4
    d = R.describe(m)  # three tries, then it stops resetting the peak statistics every step
    assert "step_growth_gib" not in d and d["inactive"] == "nothing measured in 3 steps: every recompute kept"


def test_a_model_with_two_stacks_of_checkpointed_layers_keeps_every_recompute():
    from torch import nn

    m = _model()
    vision = nn.ModuleList([R._layers(m)[0].__class__(m.config, 0)])  # a second stack, as a vision tower's
    both = nn.ModuleDict({"text": m, "vision": vision})
    R.enable(both, recompute="auto", _memory=FakeMemory)
    assert R.describe(both)["inactive"] == "2 stacks of checkpointed layers: every recompute kept"
    assert not any(isinstance(getattr(x, "_gradient_checkpointing_func", None), R.BudgetedCheckpoint)
                   for x in R._layers(both))
    assert [c for _, _, c in _steps(m, n=2)] == [[2, 2, 2]] * 2


def test_the_harness_counts_only_the_recomputes_that_ran_in_hardware_flops():
    from types import SimpleNamespace

    from harness.run.record import recomputed_share

    m = _model()
    point = SimpleNamespace(switches={"gradient_checkpointing": True})
    assert recomputed_share(point, m) == 1.0  # optim.recompute not applied: every layer recomputes
    R.enable(m, recompute="auto", _memory=FakeMemory)
    _steps(m, n=1)
    assert recomputed_share(point, m) == 1.0  # the measured step recomputed all
    _steps(m, n=1)
    assert recomputed_share(point, m) == 0.0
    assert recomputed_share(SimpleNamespace(switches={"gradient_checkpointing": False}), m) == 0.0


def test_a_measured_backward_that_raised_is_measured_again_at_the_next_step():
    """The measured step's backward raised (an out-of-memory error a batch-size search catches and
    retries): the next step measures and decides, rather than every later step keeping every
    recompute."""
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    first = R._layers(m)[0]

    def boom(*_):
        raise RuntimeError("CUDA out of memory (simulated)")

    hook = first.register_full_backward_hook(boom)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="simulated"):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    hook.remove()
    counts = [c for _, _, c in _steps(m, n=2)]
    assert "step_growth_gib" in R.describe(m) and counts[-1] == [1, 1, 1], (counts, R.describe(m))


def test_a_capture_takes_the_eager_forwards_decision_on_the_same_tokens_and_otherwise_recomputes(monkeypatch):
    capturing = [False]
    monkeypatch.setattr(R, "_capturing", lambda device: capturing[0])

    def step(m, shape, capture=False):
        capturing[0] = capture
        try:
            return _steps(m, n=1, shapes=[shape])[0]
        finally:
            capturing[0] = False

    # a capture before any eager step measured: nothing to go on, every layer recomputes, and the
    # capture is not the measured step (its allocations are the graph pool's)
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    assert step(m, (2, 32), capture=True)[2] == [2, 2, 2]
    st = vars(R.owner(m))[R._ATTR]
    assert st.growth is None and st.attempts == 0
    # a measured forward whose backward never ran, then a capture: the capture's backward does not
    # finish that measurement (its allocations are the graph pool's); the next eager step measures
    m(input_ids=torch.randint(0, 512, (2, 32)), use_cache=False)
    assert st.measuring and st.attempts == 1
    assert step(m, (2, 32), capture=True)[2] == [2, 2, 2]
    assert st.growth is None and not st.measuring and st.attempts == 0
    assert step(m, (2, 32))[2] == [2, 2, 2] and st.growth is not None  # measured, eagerly
    assert step(m, (2, 32))[2] == [1, 1, 1]

    ref = _model()
    plain = [_steps(ref, n=1, shapes=[shape])[0] for shape in [(2, 32), (2, 32), (2, 32), (2, 48)]]
    m = _model()
    R.enable(m, recompute="auto", _memory=FakeMemory)
    ours = [step(m, (2, 32)), step(m, (2, 32)),
            step(m, (2, 32), capture=True),  # the eager forward just before decided for 64 tokens
            step(m, (2, 48), capture=True)]  # other tokens: that decision is not this batch's
    assert [c for _, _, c in ours] == [[2, 2, 2], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
    for step_i, ((l0, g0, _), (l1, g1, _)) in enumerate(zip(plain, ours)):
        assert torch.equal(l0, l1), step_i
        assert all(torch.equal(g0[k], g1[k]) for k in g0), step_i
