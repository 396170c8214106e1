"""optim.offload on CPU: the stream-less path runs the same slots, staging buffers, prefetch order
and recompute as on the GPU, so equivalence and bookkeeping are checked here."""

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import optim.offload as oo
from harness.workload import models

MODES = ("none", "single", "double", "save_on_cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(name, layers=4):
    return dataclasses.replace(models.get(name), num_hidden_layers=layers)


def _batch(b=2, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (b, t), generator=g)


def _randomize_lora_b(m):
    # peft starts B at zero, which would leave every A gradient zero: nothing to compare
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _run(spec, mode, shapes=((2, 32), (2, 32)), **kw):
    """Build, enable ``mode``, run one step per shape; losses, LoRA grads, offloader."""
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    _randomize_lora_b(m)
    oo.enable(m, offload=mode, min_bytes=kw.pop("min_bytes", 0), **kw)
    losses = []
    for i, (b, t) in enumerate(shapes):
        ids = _batch(b, t, seed=i)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    return torch.stack(losses), grads, oo.get(m)


@pytest.mark.parametrize("name", ["llama-3.2-1b-tiny", "qwen3-0.6b-tiny"])
def test_modes_identical(name):
    spec = _spec(name)
    ref_loss, ref_grads, _ = _run(spec, "none")
    assert ref_grads and all(g.abs().sum() > 0 for g in ref_grads.values())
    for mode in MODES[1:]:
        loss, grads, off = _run(spec, mode)
        assert torch.equal(loss, ref_loss), mode
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=1e-7, msg=f"{mode} {k}")
        if mode in ("single", "double"):
            # the first layer's input is the embedding output, a grad-requiring leaf (kept), and
            # the last layer's input is needed first in the backward (kept)
            st = off.stats()
            assert off.mode == mode and st["offloaded"] == spec.num_hidden_layers - 2
            assert st["kept_leaf"] == 1 and st["kept_last"] == 1


def test_harness_build_checkpoint_fn():
    spec = _spec("llama-3.2-1b-tiny", 3)
    off = oo.Offloader("double", min_bytes=0)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, checkpoint_fn=off)
    ids = _batch()
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    st = off.stats()
    assert st["offloaded"] == 1 and st["backward_layers"] == 3


def test_last_layer_and_small_inputs_stay():
    spec = _spec("llama-3.2-1b-tiny", 4)
    _, _, off = _run(spec, "double", shapes=((2, 32),))
    st = off.stats()
    assert st["layers"] == 4 and st["offloaded"] == 2 and st["kept_last"] == 1
    assert st["bytes_per_layer"] == [2 * 32 * 64 * 4] * 2
    # 16 KiB layer inputs are below a 1 MiB threshold: nothing moves
    _, _, off = _run(spec, "double", shapes=((2, 32),), min_bytes=1 << 20)
    st = off.stats()
    assert st["offloaded"] == 0 and st["kept_small"] == 4 and off.host_allocs == 0


@pytest.mark.parametrize("mode", ["single", "double"])
def test_offloaded_inputs_are_released(mode):
    """Between forward and backward nothing may hold an offloaded layer input: not the autograd
    context, not the recompute closure. Otherwise offloading copies and frees nothing."""
    import gc
    import weakref

    spec = _spec("qwen3-0.6b-tiny", 6)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    oo.enable(m, offload=mode, min_bytes=0)
    off, refs = oo.get(m), []
    on_forward = off._on_forward

    def spy(x):
        refs.append(weakref.ref(x))
        return on_forward(x)

    off._on_forward = spy
    ids = _batch()
    out = m(input_ids=ids, labels=ids, use_cache=False)
    gc.collect()
    alive = [r() is not None for r in refs]
    # embedding output (a leaf autograd holds) and the last layer's input stay; the rest are gone
    assert alive == [True, False, False, False, False, True]
    out.loss.backward()
    assert off.stats()["offloaded"] == 4 and off.stats()["backward_layers"] == 6


def test_buffers_reused_across_steps():
    spec = _spec("qwen3-0.6b-tiny", 4)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    oo.enable(m, offload="double", min_bytes=0)
    off = oo.get(m)
    ptrs = None
    for step in range(3):
        ids = _batch(seed=step)
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        now = ({s: b.data_ptr() for s, b in off._host.items()}, [b.data_ptr() for b in off._staging])
        if step == 0:
            allocs, ptrs = (off.host_allocs, off.staging_allocs), now
        assert (off.host_allocs, off.staging_allocs) == allocs == (2, 2)  # layers 1 and 2
        assert now == ptrs
        assert sorted(off._host) == [0, 1] and not off._slot_owner  # all slots free after backward


def test_double_prefetches_one_layer_ahead():
    spec = _spec("llama-3.2-1b-tiny", 5)  # layers 1-3 offloaded (0: embedding leaf, 4: last)
    _, _, off = _run(spec, "double", shapes=((2, 32),))
    tr = off.trace
    computes = [e for e in tr if e[0] == "compute" and e[1] is not None]
    assert [c[1] for c in computes] == [2, 1, 0]  # backward runs in reverse forward order
    assert [c[2] for c in computes] == [0, 1, 0]  # staging buffers alternate
    for slot in (1, 0):  # the reload of layer i-1 is issued before layer i's compute starts
        load = tr.index(next(e for e in tr if e[0] == "h2d" and e[1] == slot))
        compute_next = tr.index(next(c for c in computes if c[1] == slot + 1))
        assert load < compute_next
        assert tr[load][3] == "prefetch"
    st = off.stats()
    assert st["demand_loads"] == 1 and st["prefetched"] == 2


def test_single_copies_then_computes():
    spec = _spec("llama-3.2-1b-tiny", 4)
    _, _, off = _run(spec, "single", shapes=((2, 32),))
    tr = [e for e in off.trace if e[0] != "d2h" and e[1] is not None]
    assert tr == [("h2d", 1, 0, "demand"), ("compute", 1, 0), ("h2d", 0, 0, "demand"),
                  ("compute", 0, 0)]
    assert off.staging_allocs == 1


def test_batch_shape_change_resizes():
    spec = _spec("llama-3.2-1b-tiny", 4)
    shapes = ((2, 32), (4, 32), (2, 16))
    ref_loss, ref_grads, _ = _run(spec, "none", shapes=shapes)
    loss, grads, off = _run(spec, "double", shapes=shapes)
    assert torch.equal(loss, ref_loss)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=1e-7)
    # grew once for the larger batch (2 host slots + 2 staging), not again for the smaller one
    assert off.host_allocs == 4 and off.staging_allocs == 4
    assert all(b.numel() == 4 * 32 * 64 * 4 for b in off._host.values())


class _Block(nn.Module):
    def __init__(self, d=32, p=0.0):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x, scale=1.0):
        return x + self.b(self.drop(torch.relu(self.a(x)))) * scale


@pytest.mark.parametrize("mode", ["single", "double"])
def test_standalone_module(mode):
    """Around plain modules, input without grad, dropout (RNG replayed), a keyword argument."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(p=0.3) for _ in range(4))
    x = torch.randn(8, 32)

    def run(ckpt):
        for p in blocks.parameters():
            p.grad = None
        torch.manual_seed(1)
        h = x
        for blk in blocks:
            h = ckpt(blk, h, scale=0.5)
        h.square().mean().backward()
        return [p.grad.clone() for p in blocks.parameters()]

    ref = run(lambda f, *a, **k: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False, **k))
    off = oo.Offloader(mode, min_bytes=0)
    got = run(lambda f, *a, **k: oo.checkpoint(f, *a, offloader=off, **k))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert off.stats()["offloaded"] == 3
    got2 = run(off)  # two steps in a row, the offloader called directly
    for a, b in zip(got2, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_input_grad_and_no_grad_forward():
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3))
    off = oo.Offloader("double", min_bytes=0)
    x = torch.randn(4, 32, requires_grad=True)
    h = x
    for blk in blocks:
        h = off(blk, h)
    h.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    h = x
    for blk in blocks:
        h = blk(h)
    h.sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)
    with torch.no_grad():  # eval: no recompute bookkeeping at all
        y = off(blocks[0], x)
    assert not y.requires_grad and off.stats()["layers"] == 3


def test_guard_falls_back_to_single(caplog):
    spec = _spec("llama-3.2-1b-tiny", 4)
    ref_loss, ref_grads, _ = _run(spec, "none")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    _randomize_lora_b(m)
    oo.enable(m, offload="double", min_bytes=0)
    off = oo.get(m)
    off._mem_get_info = lambda: (1 << 20, 1 << 34)  # 1 MiB free: no room for a second buffer
    with caplog.at_level(logging.WARNING, logger="optim.offload"):
        losses = []
        for i in range(2):
            ids = _batch(seed=i)
            out = m(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            losses.append(out.loss.detach())
    assert off.mode == "single" and off.staging_allocs == 1
    assert len([r for r in caplog.records if r.name == "optim.offload"]) == 1
    assert torch.equal(torch.stack(losses), ref_loss)
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=1e-7)
    # with the guard off, the same memory picture keeps double
    off2 = oo.Offloader("double", guard=False, min_bytes=0, mem_get_info=lambda: (0, 1 << 34))
    h = torch.randn(4, 32)
    for blk in [_Block() for _ in range(3)]:
        h = off2(blk, h)
    h.sum().backward()
    assert off2.mode == "double" and off2.staging_allocs == 2


def test_no_host_memory_falls_back_to_none(caplog):
    class NoPinned(oo.Offloader):
        def _alloc_host(self, nbytes, pin):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    torch.manual_seed(0)
    blocks = [_Block() for _ in range(4)]
    off = NoPinned("double", min_bytes=0)
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="optim.offload"):
        for _ in range(2):
            h = x
            for blk in blocks:
                h = off(blk, h)
            h.sum().backward()
    assert off.mode == "none" and off.stats()["offloaded"] == 0
    assert len([r for r in caplog.records if r.name == "optim.offload"]) == 1
    assert blocks[0].a.weight.grad is not None


def test_switches_env(monkeypatch):
    sw = oo.SWITCHES
    assert sw["offload"].choices == ("none", "single", "double", "save_on_cpu")
    assert sw["offload"].default == "none" and sw["offload_guard"].default is True
    monkeypatch.setenv("OPTIM_OFFLOAD", "Double")
    monkeypatch.setenv("OPTIM_OFFLOAD_GUARD", "off")
    assert sw["offload"].resolve() == "double" and sw["offload_guard"].resolve() is False
    assert sw["offload"].resolve("single") == "single"  # the keyword wins over the environment
    m = models.build(_spec("llama-3.2-1b-tiny", 2), device="cpu", dtype=torch.float32,
                     lora_rank=4, gradient_checkpointing=False)
    oo.enable(m)
    assert oo.get(m).requested_mode == "double" and oo.get(m).guard is False
    monkeypatch.setenv("OPTIM_OFFLOAD", "triple")
    with pytest.raises(ValueError, match="valid"):
        sw["offload"].resolve()


def test_import_does_not_pull_harness():
    code = "import sys, optim.offload; sys.exit(any(m.startswith('harness') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_overlap_from_trace_events():
    from harness.bench.offload import overlap_stats

    ev = [  # chrome-trace "X" events (ts/dur in µs), as torch.profiler exports them
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 150, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 50,
         "dur": 100, "args": {"stream": 20}},  # 50 µs under the first kernel, 50 in the gap
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 160,
         "dur": 40, "args": {"stream": 20}},  # fully under the second kernel
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 300,
         "dur": 10, "args": {"stream": 20}},
    ]
    st = overlap_stats(ev)
    assert st["h2d_count"] == 2 and st["h2d_streams"] == [20] and st["compute_streams"] == [7]
    assert st["h2d_us"] == 140 and st["h2d_overlapped_us"] == 90
    assert st["overlap_pct"] == pytest.approx(100 * 90 / 140)
    assert st["h2d_pinned"] == 2 and st["h2d_pageable"] == 0 and st["h2d_on_side_stream"] == 2


def test_trainer_gradient_checkpointing_keeps_the_offloader(tmp_path, caplog):
    """Trainer(args.gradient_checkpointing=True) enables checkpointing again after the user's
    optim.offload.enable: every layer must still go through the offloader, with one log line."""
    from transformers import Trainer, TrainingArguments

    spec = _spec("llama-3.2-1b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    oo.enable(m, offload="double", min_bytes=0)
    off = oo.get(m)
    data = [{"input_ids": _batch(1, 32, seed=i)[0].tolist(), "labels": _batch(1, 32, seed=i)[0].tolist()}
            for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             gradient_checkpointing=True, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    with caplog.at_level(logging.INFO, logger="optim.offload"):
        Trainer(model=m, args=args, train_dataset=data).train()
    layers = [mod for mod in m.modules() if getattr(mod, "gradient_checkpointing", False)]
    assert layers and all(mod._gradient_checkpointing_func is off for mod in layers)
    assert off.stats()["offloaded"] == spec.num_hidden_layers - 2  # the last step went through it
    told = [r.getMessage() for r in caplog.records if "enabled again" in r.getMessage()]
    assert len(told) == 1 and "keep optim.offload (double)" in told[0]
    # a second enable replaces the offloader, and a re-enable then routes to the new one
    oo.enable(m, offload="single", min_bytes=0)
    m.base_model.model.gradient_checkpointing_enable()
    assert all(mod._gradient_checkpointing_func is oo.get(m) for mod in layers) and oo.get(m) is not off


def test_a_deep_copys_checkpointing_calls_set_the_copys_layers():
    """A deep copy (TRL's reference model, an EMA copy) routes its own checkpointing: disabling it
    on the copy leaves the original's layers on, and enabling it again gives the copy's layers the
    copy's offloader, never the original's."""
    import copy

    spec = _spec("llama-3.2-1b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=True)
    oo.enable(m, offload="double", min_bytes=0)
    twin = copy.deepcopy(m)

    def layers(model):
        return [mod for mod in model.modules() if type(mod).__name__.endswith("DecoderLayer")]

    twin.gradient_checkpointing_disable()
    assert [mod.gradient_checkpointing for mod in layers(m)] == [True] * spec.num_hidden_layers
    assert [mod.gradient_checkpointing for mod in layers(twin)] == [False] * spec.num_hidden_layers
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert oo.get(twin) is not oo.get(m)
    assert all(mod.gradient_checkpointing and mod._gradient_checkpointing_func is oo.get(twin) for mod in layers(twin))
    assert all(mod._gradient_checkpointing_func is oo.get(m) for mod in layers(m))


def test_offload_profile_is_a_switch_that_times_each_reload_and_layer_backward(monkeypatch):
    """optim.enable(model, offload=..., offload_profile=True) (or OPTIM_OFFLOAD_PROFILE) reaches the
    offloader: stats() then holds one reload time per offloaded layer and one backward time per layer,
    what the (n-1)*min(c,g) bound is read from. Off, both lists stay empty."""
    import optim

    spec = _spec("qwen3-0.6b-tiny", 4)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    optim.enable(m, only=("offload",), offload="double", offload_profile=True)
    assert oo.get(m).profile is True
    assert optim.enabled(m)["optim.offload"]["resolved"]["offload_profile"] is True
    for profiled in (True, False):
        oo.enable(m, offload="double", offload_profile=profiled, min_bytes=0)
        ids = _batch()
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        st = oo.get(m).stats()
        assert st["offloaded"] == 2
        if profiled:
            assert len(st["reload_ms"]) == 2 and len(st["backward_ms"]) == 4
            assert all(t >= 0 for t in st["reload_ms"] + st["backward_ms"])
        else:
            assert st["reload_ms"] == st["backward_ms"] == []
    monkeypatch.setenv("OPTIM_OFFLOAD_PROFILE", "1")
    oo.enable(m, offload="double")
    assert oo.get(m).profile is True
    oo.enable(m, offload="double", profile=False)  # the keyword's older name still wins over the environment
    assert oo.get(m).profile is False


def test_host_memory_is_registered_only_where_its_error_can_be_cleared():
    # without a CUDA runtime loaded (a CPU build) there is no libcudart to clear a failed
    # registration's error, so pinned_empty never registers; release leaves a tensor it did not pin
    from optim.offload import hostmem

    if torch.version.cuda is None:
        assert hostmem._cudart() is None
    t = torch.zeros(16, dtype=torch.uint8)
    hostmem.release(t)
    assert t.data_ptr() not in hostmem._OWNED and int(t.sum()) == 0


def test_another_librarys_checkpointing_setter_is_kept_and_given_the_offloader():
    """A library that set its own ``_set_gradient_checkpointing`` on the model (a patch of its own
    before optim) keeps it: a later re-enable (Trainer's gradient_checkpointing=True) runs it with
    the offloader as the checkpoint function, and disable puts it back as it was."""
    import types

    spec = _spec("llama-3.2-1b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    base = oo._hf_model(m)
    calls = []

    def theirs(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        calls.append((enable, gradient_checkpointing_func))
        return type(self)._set_gradient_checkpointing(self, enable=enable, gradient_checkpointing_func=gradient_checkpointing_func)

    theirs_bound = types.MethodType(theirs, base)
    object.__setattr__(base, "_set_gradient_checkpointing", theirs_bound)
    oo.enable(m, offload="double", min_bytes=0)
    off = oo.get(m)
    base.gradient_checkpointing_enable()  # transformers' own checkpoint function, as Trainer passes it
    layers = [mod for mod in m.modules() if getattr(mod, "gradient_checkpointing", False)]
    assert layers and all(mod._gradient_checkpointing_func is off for mod in layers)
    assert calls and all(func is off for enable, func in calls if enable), calls  # theirs ran, with ours
    ids = _batch()
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert off.stats()["offloaded"] == spec.num_hidden_layers - 2
    oo.disable(m)
    assert vars(base)["_set_gradient_checkpointing"] is theirs_bound


def test_a_wrapper_set_around_the_offloaders_routing_survives_enable_again_and_disable():
    """A library that wraps the model's setter after optim.offload (its wrapper calls ours): a
    second enable keeps the wrapper and routes to the new offloader without recursing, and after
    disable the wrapper stays and its calls reach the class's setter with their own function."""
    import types

    spec = _spec("llama-3.2-1b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    base = oo._hf_model(m)
    oo.enable(m, offload="double", min_bytes=0)
    inner = vars(base)["_set_gradient_checkpointing"]
    calls = []

    def wrapper(self, **kw):
        calls.append(kw.get("enable"))
        return inner(**kw)

    object.__setattr__(base, "_set_gradient_checkpointing", types.MethodType(wrapper, base))
    oo.enable(m, offload="single", min_bytes=0)
    layers = [mod for mod in m.modules() if getattr(mod, "gradient_checkpointing", False)]
    assert layers and all(mod._gradient_checkpointing_func is oo.get(m) for mod in layers) and calls
    oo.disable(m)
    assert vars(base)["_set_gradient_checkpointing"].__func__ is wrapper
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert oo.get(m) is None and all(mod.gradient_checkpointing for mod in layers)
    assert not any(type(mod._gradient_checkpointing_func).__name__ == "Offloader" for mod in layers)
    oo.enable(m, offload="double", min_bytes=0)  # and once more: through the wrapper, to the new offloader
    assert all(mod._gradient_checkpointing_func is oo.get(m) for mod in layers)
