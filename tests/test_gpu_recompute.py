"""optim.recompute on CUDA, through optim.enable with its defaults: every step's loss and gradients
against plain checkpointing (recompute="all"), the first included; the first step measures real
activations; a GPU with room skips every recompute, a full GPU keeps them without an OOM; and a
longer batch than the measured one is judged on its own tokens; a per-process memory fraction is
the memory it plans in."""

import gc

import pytest
import torch
from _lora import randomize_lora_b

import optim
import optim.recompute as R
from optim._memory import usable_and_total
from harness.workload import models

pytestmark = pytest.mark.gpu

STEPS = 3
# A Qwen3 shape no other test uses (hidden 1024, 6 layers, GQA 16/8), LoRA r=8, 2 x 2048 tokens
SPEC = models.ModelSpec("qwen3-recompute-test", "qwen3", 6, 1024, 3072, 16, 8, 128, 4096,
                        extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))


def _batches(shapes):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, SPEC.vocab_size, s, generator=g).cuda() for s in shapes]


def _train(batches, starts=None, after_step=None, **switches):
    """Trains on ``batches`` and returns each step's loss and gradients, with the trainable weights
    each step began from (in ``steps[i][2]``). Given ``starts`` (a reference run's), each step
    begins from the reference's weights, so its gradients are compared at the same point: the
    causal kernel's backward (flash) adds in no fixed order, and an optimizer step would carry
    that run-to-run noise into every later step's weights. ``after_step(model, i)`` runs once
    step ``i``'s optimizer step and zero_grad are done, before the next forward decides."""
    gc.collect()
    torch.cuda.empty_cache()
    model = randomize_lora_b(models.build(SPEC, device="cuda", dtype=torch.bfloat16, lora_rank=8))
    optim.enable(model, **switches)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=1e-3)
    steps, skipped = [], []
    for i, ids in enumerate(batches):
        if starts is not None:
            with torch.no_grad():
                for n, p in params:
                    p.copy_(starts[i][2][n])
        start = {n: p.detach().cpu().clone() for n, p in params}
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        steps.append((loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in params}, start))
        skipped.append(R.describe(model)["layers_skipped"]["last"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model, i)
    stats = R.describe(model)
    state = vars(R.owner(model)).get(R._ATTR)
    if state is not None and state.growth is not None:  # the measurement in bytes, unrounded
        stats["raw"] = {"start_allocated": state.start_allocated, "growth": state.growth,
                        "act_per_layer": max(state.acts.values(), default=0)}
    del model, opt
    return steps, skipped, stats


@pytest.fixture(scope="module", autouse=True)
def _kernels_chosen():
    """A shape's first run in a process picks its kernels on first use, and its bf16 gradients can
    differ from every later run's by a few percent (on an H100, two recompute="all" runs of the
    same batches differed by up to 3.3 % relative when the first was the process's first, and by
    0.0 after). Each test compares two runs of one process, so both come after a throwaway run over
    every shape this file uses; a test run first in its process (a reversed shard) no longer sets
    its reference apart."""
    _train(_batches([(2, 2048), (2, 512), (2, 4096)]), recompute="all")


def _assert_steps_match(steps, ref):
    assert len(steps) == len(ref)
    for i, ((l0, g0, _), (l1, g1, _)) in enumerate(zip(ref, steps)):
        assert torch.allclose(l0, l1, rtol=2e-3, atol=2e-3), (i, l0, l1)
        for k in g0:
            err = (g0[k] - g1[k]).norm() / g0[k].norm().clamp_min(1e-12)
            assert err < 2e-2, (i, k, float(err))


def test_with_room_every_layer_skips_its_recompute_and_every_step_matches_plain_checkpointing():
    batches = _batches([(2, 2048)] * STEPS)
    ref, none_skipped, _ = _train(batches, recompute="all")
    steps, skipped, st = _train(batches, ref)
    assert none_skipped == [0] * STEPS
    assert skipped == [0] + [SPEC.num_hidden_layers] * (STEPS - 1), st  # measured first, then all skip
    assert st["measured_tokens"] == 4096 and st["activation_gib_per_layer"] > 0.01, st  # real activations
    assert st["recomputes"] == SPEC.num_hidden_layers, st  # the measured step's only
    _assert_steps_match(steps, ref)


def _fill_leaving(room_bytes: int):
    """A tensor that leaves free the headroom plus ``room_bytes``."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return torch.empty(free - R.headroom(total) - room_bytes, dtype=torch.uint8, device="cuda")


def _model_room(probe: dict) -> int:
    """What the probe's model and optimizer held at its measured step's start, beyond what the
    process holds now without them: earlier tests' cuBLAS workspaces or compiled kernels' buffers
    stay allocated in this process and are already out of the free memory a filler leaves."""
    gc.collect()
    torch.cuda.empty_cache()
    return probe["raw"]["start_allocated"] - torch.cuda.memory_allocated()


def test_a_full_gpu_keeps_the_recomputes_without_an_oom(monkeypatch):
    """Once the first step has measured, the GPU is filled to leave what the step grows, the
    headroom and half a layer's activations: every later step keeps every recompute, and nothing
    runs out of memory. The filler is sized from what the decision itself reads (the measured
    growth and activations of this model, the memory the process can still allocate), so memory
    an earlier test of the process left cached or allocated cannot move it."""
    batches = _batches([(2, 2048)] * STEPS)
    ref, _, _ = _train(batches, recompute="all")
    held, seen, rooms = [], {}, []
    plan = R.plan

    def watched(acts, growth, tokens, first_tokens, usable, total):
        # the room the decision had for activations: positive, and short of any one layer's
        rooms.append((usable - growth * max(1.0, tokens / first_tokens) - R.headroom(total), min(acts.values())))
        return plan(acts, growth, tokens, first_tokens, usable, total)

    def fill(model, i):
        if i != 0:
            return
        state = vars(R.owner(model))[R._ATTR]
        assert state.growth is not None and state.acts, R.describe(model)  # the first step measured
        gc.collect()
        torch.cuda.empty_cache()
        usable, total = usable_and_total(torch.device("cuda"))
        leave = state.growth + R.headroom(total) + max(state.acts.values()) // 2
        held.append(torch.empty(usable - leave, dtype=torch.uint8, device="cuda"))
        seen.update(leave=leave, left=usable_and_total(torch.device("cuda"))[0])
        monkeypatch.setattr(R, "plan", watched)

    try:
        steps, skipped, st = _train(batches, ref, after_step=fill)
    finally:
        held.clear()
        torch.cuda.empty_cache()
    assert len(rooms) == STEPS - 1 and all(0 < room < act for room, act in rooms), (rooms, seen)
    assert skipped == [0] * STEPS, (skipped, st, seen)
    assert st["recomputes"] == SPEC.num_hidden_layers * STEPS, st
    _assert_steps_match(steps, ref)


def test_a_longer_batch_than_the_measured_one_is_judged_on_its_tokens():
    """Measured at 2 x 512 tokens, then 2 x 4096, on a GPU with room for twice the short batch's
    activations but not for the long batch's: the long batch keeps its recomputes."""
    batches = _batches([(2, 512), (2, 512), (2, 4096), (2, 512)])
    ref, _, _ = _train(batches, recompute="all")
    _, _, probe = _train(batches[:2])
    raw = probe["raw"]
    filler = _fill_leaving(_model_room(probe) + raw["growth"] + 2 * SPEC.num_hidden_layers * raw["act_per_layer"])
    try:
        steps, skipped, st = _train(batches, ref)
    finally:
        del filler
        torch.cuda.empty_cache()
    assert skipped[1] == skipped[3] == SPEC.num_hidden_layers and skipped[2] < SPEC.num_hidden_layers, (skipped, st)
    _assert_steps_match(steps, ref)


def test_a_per_process_memory_fraction_is_the_memory_it_plans_in():
    """The GPU has room, but the process is held by ``torch.cuda.set_per_process_memory_fraction``
    to the model, the checkpointed step, three layers' activations and the headroom: some layers
    skip their recompute, not all, and nothing runs out of memory (read from the free device memory
    alone, every layer would skip and the allocator would refuse the step)."""
    batches = _batches([(2, 2048)] * STEPS)
    ref, _, _ = _train(batches, recompute="all")
    _, _, probe = _train(batches[:2])
    raw = probe["raw"]
    total = torch.cuda.mem_get_info()[1]
    cap = torch.cuda.memory_allocated() + _model_room(probe) + raw["growth"] + 3 * raw["act_per_layer"] + R.GIB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        steps, skipped, st = _train(batches, ref)  # the allocator raises past the fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert all(0 < n < SPEC.num_hidden_layers for n in skipped[1:]), (skipped, st)
    _assert_steps_match(steps, ref)
