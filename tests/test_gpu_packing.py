"""optim.packing on CUDA (bf16): every backend including varlen, gradients included, and no T×T
mask on the flex/varlen paths. Skipped on CPU by tests/conftest.py. Kept small: flex compiles."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _lora import randomize_lora_b

import optim.packing as P
from optim._syncs import is_sync_warning
from optim.packing import backends as PB
from harness.workload import models

pytestmark = pytest.mark.gpu

LENGTHS = [[37, 150, 13], [200]]  # not multiples of 128, a full row, docs > window 32, B = 2


def _build(name, dtype=torch.bfloat16):
    model = models.build(models.get(name), device="cuda", dtype=dtype, lora_rank=4,
                         gradient_checkpointing=True)
    return randomize_lora_b(model)


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model, ids, lengths):
    """Stock eager attention (exact sinks and windows), each document alone."""
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    total, rows = 0.0, []
    count = sum(l - 1 for r in lengths for l in r)
    for r, row in enumerate(lengths):
        s, parts = 0, []
        for l in row:
            x = ids[r, s:s + l]
            lg = model(input_ids=x[None], position_ids=torch.arange(l, device="cuda")[None],
                       use_cache=False).logits[0]
            total = total + F.cross_entropy(lg[:-1].float(), x[1:], reduction="sum")
            parts.append(lg.detach().float())
            s += l
        rows.append(torch.cat(parts))
    (total / count).backward()
    P.register()  # the name must be registered before transformers accepts it
    model.set_attn_implementation(P.ATTN_NAME)
    return torch.stack(rows), (total / count).detach(), _grads(model)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


@pytest.mark.parametrize("name", ["llama-3.2-1b-tiny", "qwen3-30b-a3b-tiny", "gpt-oss-20b-tiny"])
def test_every_backend_matches_documents_alone_bf16(name):
    spec = models.get(name)
    # MoE in bf16: rounding differences between the packed and per-document runs flip top-k
    # expert choices (seen on the H100, rel. logit error 0.06), which says nothing about
    # packing. MoE models are checked in fp32 on sdpa/flex; varlen (half precision only) on
    # the dense model here and against an fp64 reference on CPU.
    dtype = torch.float32 if spec.is_moe else torch.bfloat16
    backends = ("sdpa", "flex") if spec.is_moe else ("sdpa", "flex", "varlen")
    model = _build(name, dtype)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 200), device="cuda")
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    ref_logits, ref_loss, ref_grads = _reference(model, ids, LENGTHS)
    labels = ids.clone()
    pos = meta.position_ids().cuda()
    labels[pos == 0] = -100
    for backend in backends:
        for cache in (True, False):
            P.enable(model, packing_backend=backend, packing_cache=cache)
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False,
                        **P.packed_kwargs(meta))
            out.loss.backward()
            tag = f"{name} {backend} cache={cache}"
            assert _rel(out.logits, ref_logits) < 2e-2, tag
            assert abs(out.loss.item() - ref_loss.item()) < 2e-2 * max(1.0, ref_loss.item()), tag
            grads = _grads(model)
            assert set(grads) == set(ref_grads), tag
            worst = max(_rel(grads[n], ref_grads[n]) for n in ref_grads)
            assert worst < 6e-2, (tag, worst)
    assert P.cached_entry("cuda") is None


def test_auto_picks_varlen_and_sync_free_with_metadata():
    model = _build("llama-3.2-1b-tiny")
    P.enable(model)  # auto
    assert P.resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "varlen"  # eager layers
    assert P.describe(model)["packing_backend_resolved"] == "varlen"
    ids = torch.randint(0, 512, (2, 200), device="cuda")
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    pos = meta.position_ids().cuda()
    model(input_ids=ids, position_ids=pos, use_cache=False, **P.packed_kwargs(meta)).logits.sum().backward()
    P.reset_counters()
    P.release()
    pos = meta.position_ids().cuda()  # the next batch: a new tensor, as a loop's collator gives
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # every device-to-host sync warns, with its caller
        try:
            out = model(input_ids=ids, position_ids=pos, use_cache=False, **P.packed_kwargs(meta))
            out.logits.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    ours = [w for w in caught if "optim/packing" in (w.filename or "") and is_sync_warning(w)]
    assert not ours, [f"{w.filename}:{w.lineno} {w.message}" for w in ours]
    assert P.counters()["metadata"] == 1 and P.counters().get("host_syncs", 0) == 0
    assert P.counters()["position_id_checks"] == 1  # the new batch's positions were checked, on the device
    P.raise_pending(wait=True)  # and agreed
    P.release()


def test_positions_that_disagree_raise_by_the_next_batch_without_a_host_sync():
    """Wrong position_ids beside packing= on the GPU: the check is queued behind the batch's
    kernels (no sync) and raises, naming them, by the time the next batch starts at the latest."""
    from optim.packing import checks

    meta = P.PackedMetadata.from_lengths(LENGTHS)
    entry = P.build_entry(("meta", meta.serial), meta, torch.device("cuda"))
    good = meta.position_ids().cuda()
    bad = good.clone()
    bad[1, 150] = 3
    # once first, untimed: a process's first check pays one-off costs (its first pinned buffer, the
    # kernels' first launch) that can outlast the sleep below when this test runs first
    checks.compare(entry.start, good, "packing=M")
    P.raise_pending(wait=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync raises
    try:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU busy: the checks cannot have finished below
        checks.compare(entry.start, good, "packing=M")
        checks.compare(entry.start, bad, "packing=M")
        P.raise_pending()
        assert checks.pending() == 2
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(ValueError, match=r"packing=M disagree .* row 1, token 150: position 3, where the "
                                         r"documents give 150 .* found on cuda:0"):
        P.raise_pending(wait=True)
    assert checks.pending() == 0

    model = _build("llama-3.2-1b-tiny")
    P.enable(model)
    ids = torch.randint(0, 512, (2, 200), device="cuda")
    with pytest.raises(ValueError, match="at row 1, token 150: position 3"):
        for _ in range(2):  # the first step's backward, or else the second batch, raises
            model(input_ids=ids, labels=ids, position_ids=bad, use_cache=False,
                  **P.packed_kwargs(P.PackedMetadata.from_lengths(LENGTHS))).loss.backward()
    P.release()


def _packed_forward_peak(model, T, grad=False):
    """Peak bytes above the start of one packed forward (+ backward) at T tokens; the kernels."""
    lengths = [[1000] * (T // 1000) + ([T % 1000] if T % 1000 else [])]
    meta = P.PackedMetadata.from_lengths(lengths)
    ids = torch.randint(0, 512, (1, T), device="cuda")
    pos = meta.position_ids().cuda()
    P.reset_counters()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.set_grad_enabled(grad):
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, **P.packed_kwargs(meta))
        if grad:
            out.logits.float().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, P.kernels()


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_no_txt_mask_at_16k(backend):
    """No allocation of T x T scale. The smallest T x T tensor, a bool mask, is T² bytes (256 MiB
    at 16K); the healthy forward peaks near 70 MB, and the unfused flex at 27.9 GB."""
    T = 16384
    model = _build("llama-3.2-1b-tiny")
    P.enable(model, packing_backend=backend)
    peak, ran = _packed_forward_peak(model, T)
    print(f"{backend} forward at {T} tokens: peak {peak / 2**20:.1f} MiB, kernels {ran}")
    assert peak < T * T, peak
    assert ran == {("flex-fused" if backend == "flex" else "varlen"): models.get("llama-3.2-1b-tiny").num_hidden_layers}
    if backend == "flex":
        assert P.fused_flex_failure() is None
    P.release()


def _fill_flex_attention_cache():
    """What a process that compiled flex elsewhere looks like: transformers compiles
    flex_attention with dynamic=False (one dynamo cache entry per shape) and every such compile
    shares flex_attention's cache. Fill it past the limit (the eager backend: entries are entries).
    The caller must ``torch._dynamo.reset()`` afterwards: until then stock transformers flex runs
    unfused in this process, and a test that captures it as a CUDA graph fails."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    limit = getattr(cfg, "recompile_limit", None) or cfg.cache_size_limit
    stock = torch.compile(flex_attention, backend="eager", dynamic=False)
    with torch.no_grad():
        for i in range(limit + 1):
            x = torch.randn(1, 2, 128 * (i + 1), 16, device="cuda", dtype=torch.bfloat16)
            stock(x, x, x)
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) >= limit


def test_fused_flex_after_other_compiled_code():
    """Compiled layers, a graphed step and a full flex_attention cache first; then optim.packing's
    flex still runs the fused kernel, forward and backward, with no T x T allocation."""
    from optim import graphs
    from optim import regional as R

    comp = _build("qwen3-0.6b-tiny")
    P.enable(comp, packing_backend="flex")
    R.enable(comp, compile_layers=True)
    _packed_forward_peak(comp, 1024, grad=True)
    assert R.describe(comp)["layer_calls"]["compiled"] > 0

    stock = models.build(models.get("llama-3.2-1b-tiny"), device="cuda", dtype=torch.bfloat16, lora_rank=4,
                         gradient_checkpointing=True, checkpoint_preserve_rng=False)
    opt = torch.optim.AdamW([p for p in stock.parameters() if p.requires_grad], fused=True, capturable=True)
    ids = torch.randint(0, 512, (1, 256), device="cuda")
    step = graphs.GraphedStep(lambda: stock(input_ids=ids, labels=ids, use_cache=False).loss, opt)
    step.capture()
    step.forward()
    step.backward()
    step.optimizer_step()

    try:
        _fill_flex_attention_cache()
        T = 16384  # at 8192 the healthy step's own activations (72 MiB) already exceed T² bytes
        model = _build("llama-3.2-1b-tiny")
        P.enable(model, packing_backend="flex")
        peak, ran = _packed_forward_peak(model, T, grad=True)
    finally:
        torch._dynamo.reset()  # give flex_attention's cache back to the tests after this one
    print(f"flex forward+backward at {T} tokens after other compiled code: peak {peak / 2**20:.1f} MiB, "
          f"kernels {ran}")
    assert P.fused_flex_failure() is None
    assert set(ran) == {"flex-fused"}, ran
    assert peak < T * T, peak
    P.release()


def test_varlen_stands_in_when_fused_flex_cannot_run(monkeypatch, caplog):
    """When the fused kernel cannot be had, bf16 runs varlen (one log line, same numbers) and
    fp32 refuses; the unfused flex never runs."""
    import logging

    model = _build("llama-3.2-1b-tiny")
    P.enable(model, packing_backend="flex")
    ids = torch.randint(0, 512, (2, 200), device="cuda")
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    pos = meta.position_ids().cuda()

    def run():
        model.zero_grad(set_to_none=True)
        P.reset_counters()
        out = model(input_ids=ids, labels=ids, position_ids=pos, use_cache=False, **P.packed_kwargs(meta))
        out.loss.backward()
        return out.logits.detach(), _grads(model), P.kernels()

    fused_logits, fused_grads, ran = run()
    assert set(ran) == {"flex-fused"}
    monkeypatch.setattr(PB, "_fused_flex_failed", "the compiler failed (planted by the test)")
    monkeypatch.setattr(PB, "_stand_in_logged", False)
    caplog.clear()  # enable() said which attention it replaced; only the stand-in's line counts here
    with caplog.at_level(logging.WARNING, logger="optim.packing"):
        logits, grads, ran = run()
        run()
    assert set(ran) == {"varlen"}, ran
    ours = [r.getMessage() for r in caplog.records if r.name == "optim.packing"]
    assert len(ours) == 1 and "planted by the test" in ours[0], ours
    assert _rel(logits, fused_logits) < 2e-2
    assert max(_rel(grads[n], fused_grads[n]) for n in fused_grads) < 6e-2

    model32 = _build("llama-3.2-1b-tiny", dtype=torch.float32)
    P.enable(model32, packing_backend="flex")
    with pytest.raises(P.FusedFlexUnavailable, match="planted by the test"):
        model32(input_ids=ids, position_ids=pos, use_cache=False, **P.packed_kwargs(meta))
    P.release()


def _attention_forward_backward(kernel, T, heads=32, kv_heads=8, D=128):
    """One document of T tokens with Llama-3.1-8B's heads: q, k, v gradients and the peak of the
    forward + backward above its inputs (bytes), measured as harness.bench.attention measures it."""
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, heads, T, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, T, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, T, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(1, T, heads, D, device="cuda", dtype=torch.bfloat16, generator=g)
    entry = P.build_entry(("split-test", T), P.PackedMetadata.from_lengths([[T]]), torch.device("cuda"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = kernel(entry, q, k, v, D ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base  # read before the fp32 copies below add to it
    return [x.float() for x in grads], peak


def test_split_attention_backward_matches_the_whole_one_and_holds_less():
    """attention_split on the real flash kernel, one 32768-token document with grouped KV heads:
    the gradients of causal SDPA's whole backward (within bf16 rounding: the kernels accumulate dQ
    in orders of their own), and a lower peak. Whole, the backward holds dQ's fp32 accumulator
    (16 KiB a token), dK and dV per query head (8 each) and the three gradients (12); split, the
    gradients and one group's share of the rest."""
    T = 32768
    P.reset_counters()
    whole, whole_peak = _attention_forward_backward(lambda e, q, k, v, s: PB.sdpa_causal(q, k, v, s), T)
    split, split_peak = _attention_forward_backward(
        lambda e, q, k, v, s: PB._varlen(e, q, k, v, s, None, None, True, split=True), T)
    per_token = lambda b: b / T / 1024  # noqa: E731
    print(f"forward + backward peak: whole {per_token(whole_peak):.1f} KiB a token, split {per_token(split_peak):.1f}; "
          f"kernels {P.kernels()}", flush=True)
    errors = {name: ((a - b).norm() / a.norm()).item() for name, a, b in zip("qkv", whole, split)}
    print(f"relative differences of dq, dk, dv: {errors}", flush=True)
    assert P.kernels() == {"varlen-split": 1}
    assert max(errors.values()) < 2e-2, errors
    assert per_token(whole_peak) > 48  # flash's buffers for all heads at once: the site this switch answers
    assert per_token(split_peak) < per_token(whole_peak) - 24, (whole_peak, split_peak)
    P.release()
