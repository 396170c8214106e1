"""optim.offload on CUDA: equivalence in bf16, pinned pools, the memory-guard fallback under a
filled GPU, and a profiler trace showing pinned H2D copies on the side stream under backward
kernels. Fast (seconds)."""

import dataclasses
import logging

import pytest
import torch
from torch import nn

import optim.offload as oo
from harness import models

pytestmark = pytest.mark.gpu

MODES = ("none", "single", "double", "save_on_cpu")


def _run_model(mode, steps=2, **kw):
    spec = dataclasses.replace(models.get("llama-3.2-1b-tiny"), num_hidden_layers=4)
    m = models.build(spec, device="cuda", dtype=torch.bfloat16, lora_rank=4, gradient_checkpointing=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.05)
    oo.enable(m, offload=mode, min_bytes=0, **kw)
    losses = []
    for i in range(steps):
        ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(i)).cuda()
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach().float())
    torch.cuda.synchronize()
    grads = {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}
    return torch.stack(losses).cpu(), grads, oo.get(m)


def test_modes_identical_bf16():
    ref_loss, ref_grads, _ = _run_model("none")
    for mode in MODES[1:]:
        loss, grads, off = _run_model(mode)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=mode)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-2, atol=1e-5, msg=f"{mode} {k}")
        if mode in ("single", "double"):
            st = off.stats()
            # layer 0's input is the embedding leaf and layer 3's is needed first: both stay
            assert off.mode == mode and st["offloaded"] == 2 and st["backward_layers"] == 4


def test_pinned_pool_and_profile_events():
    _, _, off = _run_model("double", steps=3, profile=True)
    st = off.stats()
    assert off._host and all(b.is_pinned() for b in off._host.values()) and st["host_pinned"]
    assert all(b is not None and b.is_cuda for b in off._staging)
    assert off.host_allocs == 2 and off.staging_allocs == 2  # sized on step 1, reused after
    assert len(st["reload_ms"]) == 2 and all(t > 0 for t in st["reload_ms"])
    assert len(st["backward_ms"]) == 4 and all(t > 0 for t in st["backward_ms"])
    assert st["prefetched"] == 1 and st["demand_loads"] == 1


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _blocks_step(off, blocks, x):
    h = x
    for blk in blocks:
        h = off(blk, h)
    h.float().square().mean().backward()


def test_guard_falls_back_under_filled_gpu(caplog):
    torch.manual_seed(0)
    d = 1024
    blocks = nn.ModuleList(_Block(d) for _ in range(4)).cuda().bfloat16()
    x = torch.randn(2048, d, device="cuda", dtype=torch.bfloat16)  # 4 MiB per layer input
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    # leave ~200 MiB: plenty for this step, less than the guard's 512 MiB headroom
    filler = torch.empty(max(0, free - (200 << 20)), dtype=torch.uint8, device="cuda")
    try:
        off = oo.Offloader("double", min_bytes=0)
        with caplog.at_level(logging.WARNING, logger="optim.offload"):
            for _ in range(2):
                _blocks_step(off, blocks, x)
            torch.cuda.synchronize()
        assert off.mode == "single", off.fallbacks
        assert off._staging[1] is None and off.staging_allocs == 1
        assert len([r for r in caplog.records if r.name == "optim.offload"]) == 1
        ref = [p.grad.clone() for p in blocks.parameters()]
    finally:
        del filler
        torch.cuda.empty_cache()
    for p in blocks.parameters():
        p.grad = None
    off2 = oo.Offloader("double", min_bytes=0)  # with the memory back, double stays double
    _blocks_step(off2, blocks, x)
    _blocks_step(off2, blocks, x)
    assert off2.mode == "double" and off2.staging_allocs == 2
    for a, b in zip(ref, blocks.parameters()):
        torch.testing.assert_close(b.grad, a, rtol=1e-2, atol=1e-5)  # single and double agree


def _trace(mode, blocks, x):
    from torch.profiler import ProfilerActivity, profile

    from harness.bench_offload import overlap_stats, trace_events

    off = oo.Offloader(mode, min_bytes=0)
    _blocks_step(off, blocks, x)  # step 1 sizes the pools
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _blocks_step(off, blocks, x)
        torch.cuda.synchronize()
    return overlap_stats(trace_events(prof)), off


def test_trace_h2d_pinned_on_side_stream_overlapping_backward():
    torch.manual_seed(0)
    d = 2048
    blocks = nn.ModuleList(_Block(d) for _ in range(8)).cuda().bfloat16()
    x = torch.randn(16384, d, device="cuda", dtype=torch.bfloat16)  # 64 MiB per layer input
    double, off = _trace("double", blocks, x)
    single, _ = _trace("single", blocks, x)
    print("double", double, "\nsingle", single)
    assert double["h2d_count"] >= 7  # one reload per offloaded layer (all but the last)
    assert double["h2d_pinned"] == double["h2d_count"] and double["h2d_pageable"] == 0
    assert double["h2d_on_side_stream"] == double["h2d_count"]
    assert double["overlap_pct"] > 50
    assert single["overlap_pct"] < double["overlap_pct"]


@pytest.mark.parametrize("mode", ["single", "double"])
def test_offload_frees_device_memory(mode):
    """Between forward and backward the offloaded inputs no longer occupy the GPU: the device
    holds the last layer's input and one staging buffer, not L inputs."""
    torch.manual_seed(0)
    d, layers = 2048, 8
    blocks = nn.ModuleList(_Block(d) for _ in range(layers)).cuda().bfloat16()
    x = torch.randn(16384, d, device="cuda", dtype=torch.bfloat16)  # 64 MiB per layer input
    act = x.numel() * x.element_size()

    def held_after_forward(ckpt):
        for _ in range(2):  # the second step runs with the pools already sized
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            h = x
            for blk in blocks:
                h = ckpt(blk, h)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # processes the copy stream's events: freed blocks count as freed
            held = torch.cuda.memory_allocated() - base
            h.float().square().mean().backward()
        return held

    plain = held_after_forward(lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False))
    off = oo.Offloader(mode, min_bytes=0)
    offloaded = held_after_forward(off)
    assert off.stats()["offloaded"] == layers - 1
    # plain keeps layers-1 inputs (x is the caller's); offloaded keeps none of them, plus the
    # output, the last input (kept) and one or two staging buffers sized like an input
    assert plain - offloaded >= (layers - 1 - 3) * act, (plain / act, offloaded / act)
