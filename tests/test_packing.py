"""optim.packing on CPU (fp32): packed == each document alone, cache policy, counts, collator.

flex_attention has no CPU backward in torch, so flex is checked forward-only here (logits and
loss under no_grad) and with gradients in tests/test_gpu_packing.py, together with varlen.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from _lora import randomize_lora_b

import optim.packing as P
from optim.packing import backends as PB
from harness.workload import models

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

FAMILIES = ["llama-3.2-1b-tiny", "qwen3-0.6b-tiny", "qwen3-30b-a3b-tiny", "gpt-oss-20b-tiny"]
# batch of 2 rows x 100 tokens: lengths not multiples of 128, one document filling a row, and
# documents longer than gpt-oss-tiny's sliding window (32)
LENGTHS = [[37, 50, 13], [100]]


def _build(name, checkpointing=True):
    model = models.build(models.get(name), device="cpu", dtype=torch.float32, lora_rank=4,
                         gradient_checkpointing=checkpointing)
    return randomize_lora_b(model)


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _build(name)
        return cache[name]

    return get


def _ce_sum(logits, ids):
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _reference(model, ids, lengths, grads=True):
    """Stock eager attention, each document alone. Returns logits (B,T,V), loss, LoRA grads."""
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    rows, total, count = [], 0.0, sum(l - 1 for row in lengths for l in row)
    with torch.set_grad_enabled(grads):
        for r, row in enumerate(lengths):
            s, parts = 0, []
            for l in row:
                x = ids[r, s:s + l]
                logits = model(input_ids=x[None], position_ids=torch.arange(l)[None], use_cache=False).logits[0]
                total = total + _ce_sum(logits, x)
                parts.append(logits.detach())
                s += l
            rows.append(torch.cat(parts))
        loss = total / count
        if grads:
            loss.backward()
    model.set_attn_implementation(P.ATTN_NAME)
    return torch.stack(rows), loss.detach(), _lora_grads(model) if grads else None


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed(model, ids, meta, grads=True, with_meta=True):
    model.zero_grad(set_to_none=True)
    labels = ids.clone()
    pos = meta.position_ids()
    labels[pos == 0] = -100
    kw = P.packed_kwargs(meta) if with_meta else {}
    with torch.set_grad_enabled(grads):
        out = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw)
        if grads:
            out.loss.backward()
    return out.logits.detach(), out.loss.detach(), _lora_grads(model) if grads else None


def _close(a, b, tol=2e-5):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _check_grads(g, ref):
    assert set(g) == set(ref) and len(g) > 0
    for n in ref:
        _close(g[n], ref[n], 1e-4)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_equals_documents_alone(built, name, cache, backend):
    """SDPA: logits, loss and LoRA grads, metadata handed over or read from position_ids.
    Flex on CPU: the forward (its backward runs in the GPU tests)."""
    model = built(name)
    P.enable(model, packing_backend=backend, packing_cache=cache)
    grads = backend == "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 100))
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    ref_logits, ref_loss, ref_grads = _reference(model, ids, LENGTHS, grads=grads)
    for with_meta in ((True, False) if grads else (True,)):
        logits, loss, got = _packed(model, ids, meta, with_meta=with_meta, grads=grads)
        _close(logits, ref_logits)
        _close(loss, ref_loss)
        if grads:
            _check_grads(got, ref_grads)


@pytest.mark.parametrize("name", ["llama-3.2-1b-tiny", "gpt-oss-20b-tiny"])
def test_hundreds_of_one_token_documents(built, name):
    model = built(name)
    lengths = [[1] * 200 + [45, 5]]
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (1, 250))
    meta = P.PackedMetadata.from_lengths(lengths)
    ref_logits, ref_loss, ref_grads = _reference(model, ids, lengths)
    P.enable(model, packing_backend="sdpa")
    logits, loss, grads = _packed(model, ids, meta)
    _close(logits, ref_logits)
    _close(loss, ref_loss)
    _check_grads(grads, ref_grads)
    P.enable(model, packing_backend="flex")
    logits, _, _ = _packed(model, ids, meta, grads=False)
    _close(logits, ref_logits)


@pytest.mark.parametrize("window", [None, 32, 200])
def test_flex_block_mask_matches_exact_block_classification(window):
    """The block-level construction equals create_block_mask's exact any/all classification."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2):
        row, left = [], 1000
        while left:
            l = min(left, int(torch.randint(1, 300, (1,), generator=gen)))
            row.append(l)
            left -= l
        rows.append(row)
    meta = P.PackedMetadata.from_lengths(rows)
    entry = P.build_entry(("test",), meta, torch.device("cpu"))
    ours = P.build_flex_block_mask(entry, window)
    doc = entry.doc

    def mm(b, h, q, k):
        keep = (doc[b, q] == doc[b, k]) & (q >= k)
        return keep & (q - k < window) if window is not None else keep

    exact = create_block_mask(mm, 2, None, 1000, 1000, device="cpu")

    def blocks(nums, idx):
        return [[set(idx[b, 0, i, : nums[b, 0, i]].tolist()) for i in range(nums.shape[2])] for b in range(2)]

    assert blocks(ours.kv_num_blocks, ours.kv_indices) == blocks(exact.kv_num_blocks, exact.kv_indices)
    assert blocks(ours.full_kv_num_blocks, ours.full_kv_indices) == blocks(
        exact.full_kv_num_blocks, exact.full_kv_indices)


def test_bad_input_gives_clear_errors(built):
    with pytest.raises(ValueError, match="sum to"):
        P.PackedMetadata.from_lengths([[3, 4], [5, 3]])
    with pytest.raises(ValueError, match="zero-length"):
        P.PackedMetadata.from_lengths([[3, 0, 4]])
    with pytest.raises(ValueError, match="disagree"):
        P.PackedMetadata.from_lengths([[3, 4]], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))
    model = built("llama-3.2-1b-tiny")
    P.enable(model, packing_backend="sdpa")
    ids = torch.randint(0, 512, (1, 7))
    meta = P.PackedMetadata.from_lengths([[3, 4]])
    with pytest.raises(ValueError, match="disagree"):
        model(input_ids=ids, position_ids=torch.arange(7)[None], use_cache=False, **P.packed_kwargs(meta))
    with pytest.raises(ValueError, match="restart at 0"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 4, 5, 6, 7]]), use_cache=False)
    with pytest.raises(ValueError, match="batch is|does not match"):
        model(input_ids=torch.randint(0, 512, (1, 8)), use_cache=False, **P.packed_kwargs(meta))


def _step(model, ids, meta, with_meta=True):
    labels = ids.clone()
    pos = meta.position_ids()
    labels[pos == 0] = -100
    kw = P.packed_kwargs(meta) if with_meta else {}
    out = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw)
    out.loss.backward()


@pytest.mark.parametrize("name,windows", [("llama-3.2-1b-tiny", 1), ("gpt-oss-20b-tiny", 2)])
@pytest.mark.parametrize("with_meta", [True, False])
def test_build_counts_with_gradient_checkpointing(built, name, windows, with_meta):
    model = built(name)
    layers = model.config.num_hidden_layers
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    ids = torch.randint(0, 512, (2, 100))
    P.enable(model, packing_backend="sdpa", packing_cache=True)
    for _ in range(2):  # per step, every step
        P.reset_counters()
        _step(model, ids, meta, with_meta)
        c = P.counters()
        assert c["metadata"] == 1 and c["sdpa_mask"] == windows, c
        assert c.get("position_id_reads", 0) == (0 if with_meta else 1), c
        assert c["cache_hits"] == 2 * layers - 1, c  # forward + checkpoint recompute
    P.enable(model, packing_backend="sdpa", packing_cache=False)
    P.reset_counters()
    _step(model, ids, meta, with_meta)
    c = P.counters()
    assert c["metadata"] == 2 * layers and c["sdpa_mask"] == 2 * layers, c
    assert c.get("position_id_reads", 0) == (0 if with_meta else 2 * layers), c
    P.enable(model, packing_backend="flex", packing_cache=True)
    P.reset_counters()
    with torch.no_grad():
        model(input_ids=ids, position_ids=meta.position_ids(), use_cache=False, **P.packed_kwargs(meta))
    assert P.counters()["flex_block_mask"] == windows
    P.release()


def test_no_mask_outlives_the_step_and_new_batch_replaces(built):
    model = built("gpt-oss-20b-tiny")
    P.enable(model, packing_backend="sdpa", packing_cache=True)
    ids = torch.randint(0, 512, (2, 100))
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    cpu = torch.device("cpu")
    refs = []
    orig = P.build_sdpa_mask

    def spy(*a, **k):
        m = orig(*a, **k)
        refs.append(weakref.ref(m))
        return m

    PB.build_sdpa_mask = spy
    try:
        _step(model, ids, meta)
        assert P.cached_entry(cpu) is None  # released when the backward left the first layer
        gc.collect()
        assert refs and all(r() is None for r in refs)
        # no grad: the entry lives until the next batch replaces it
        refs.clear()
        with torch.no_grad():
            model(input_ids=ids, position_ids=meta.position_ids(), use_cache=False, **P.packed_kwargs(meta))
            assert P.cached_entry(cpu).key == ("meta", meta.serial) and all(r() is not None for r in refs)
            meta2 = P.PackedMetadata.from_lengths([[60, 40], [100]])
            model(input_ids=ids, position_ids=meta2.position_ids(), use_cache=False, **P.packed_kwargs(meta2))
        gc.collect()
        assert P.cached_entry(cpu).key == ("meta", meta2.serial)
        assert all(r() is None for r in refs[:2])
    finally:
        PB.build_sdpa_mask = orig
        P.release()


def test_in_place_position_ids_edit_is_not_stale(built):
    """Policy: without metadata the cache is keyed on the position_ids object and its _version,
    so an in-place edit rebuilds (a PackedMetadata is immutable and is the source of truth)."""
    model = built("llama-3.2-1b-tiny")
    P.enable(model, packing_backend="sdpa", packing_cache=True)
    ids = torch.randint(0, 512, (1, 100))
    pos = P.PackedMetadata.from_lengths([[50, 50]]).position_ids()
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        pos.copy_(torch.arange(100)[None])  # same tensor, now one document
        P.reset_counters()
        b = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert P.counters()["metadata"] == 1
        ref, _, _ = _reference(model, ids, [[100]], grads=False)
    _close(b, ref)
    assert (a - b).abs().max() > 1e-3
    P.release()


@pytest.mark.parametrize("name", ["llama-3.2-1b-tiny", "gpt-oss-20b-tiny"])
def test_flash_attn_kwargs_of_the_transformers_collator_are_the_metadata(built, name):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) and TRL's padding-free batches
    carry cu_seq_lens_q/k and max_length_q/k: the entry is built from them (never from
    position_ids), and equals each document alone."""
    from transformers import DataCollatorWithFlattening

    model = built(name)
    P.enable(model, packing_backend="sdpa")
    torch.manual_seed(0)
    docs = [torch.randint(0, 512, (n,)).tolist() for n in (37, 50, 13, 29)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(
        [{"input_ids": d} for d in docs])
    assert isinstance(batch["max_length_q"], int) and batch["cu_seq_lens_q"].tolist() == [0, 37, 87, 100, 129]
    ref_logits, ref_loss, ref_grads = _reference(model, batch["input_ids"], [[37, 50, 13, 29]])
    model.zero_grad(set_to_none=True)
    P.reset_counters()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    _close(out.logits.detach(), ref_logits)
    _check_grads(_lora_grads(model), ref_grads)
    c = P.counters()
    assert c["from_cu_seqlens"] == 1 and c["metadata"] == 1 and "position_id_reads" not in c, c

    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, 37, 90], dtype=torch.int32))
    with pytest.raises(ValueError, match="must rise from 0 to the batch's 1x129 = 129 tokens"):
        model(**bad, use_cache=False)
    with pytest.raises(ValueError, match="below the longest document"):
        model(**dict(batch, max_length_q=20), use_cache=False)
    P.release()


def test_entry_from_cu_seqlens_equals_the_host_built_entry():
    """Device-side metadata (cu_seqlens with a zero-length document, two rows) against the entry
    built from the host lengths."""
    from optim.packing.metadata import entry_from_cu_seqlens

    meta = P.PackedMetadata.from_lengths([[3, 60, 1], [2, 62]])
    host = P.build_entry(("h",), meta, torch.device("cpu"))
    cu = torch.tensor([0, 3, 63, 63, 64, 66, 128], dtype=torch.int32)  # one empty document at 63
    dev = entry_from_cu_seqlens(("d",), cu, 62, 2, 64, torch.device("cpu"))
    assert torch.equal(dev.start, host.start)

    def same_doc(e):  # document ids may differ by the empty one; who shares a document may not
        return e.doc[:, :, None] == e.doc[:, None, :]

    assert torch.equal(same_doc(dev), same_doc(host))


def test_enable_says_which_attention_it_replaced_and_keeps_one_it_cannot_judge(caplog):
    model = _build("llama-3.2-1b-tiny")
    with caplog.at_level("WARNING", logger="optim.packing"):
        P.enable(model)
    assert model.config._attn_implementation == P.ATTN_NAME
    (line,) = [r.getMessage() for r in caplog.records]
    assert "attention 'sdpa' replaced by 'optim_packed'" in line and "packing_backend='off'" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="optim.packing"):
        P.enable(model)  # again: nothing replaced, nothing said
    assert not caplog.records

    from transformers import AttentionInterface

    AttentionInterface.register("my_attention", AttentionInterface._global_mapping["sdpa"])
    mine = _build("llama-3.2-1b-tiny")
    mine.set_attn_implementation("my_attention")
    with caplog.at_level("WARNING", logger="optim.packing"):
        P.enable(mine)
    assert mine.config._attn_implementation == "my_attention" and P.describe(mine) == {}
    assert "kept your attention implementation 'my_attention'" in caplog.records[0].getMessage()


def test_collator_and_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": list(range(10, 70))}, {"input_ids": [1, 2]}]
    batch = P.PackingCollator(max_length=64, pad_token_id=0, pad_to_max_length=True)(examples)
    assert batch["input_ids"].shape == (2, 64)
    assert batch["packing"].lengths == ((3, 60, 1), (2, 62))
    assert batch["labels"][0, :4].tolist() == [-100, 6, 7, -100]
    assert batch["labels"][0, 63].item() == -100 and batch["labels"][1, 2:].eq(-100).all()
    assert batch["position_ids"][0, :5].tolist() == [0, 1, 2, 0, 1]

    model = _build("llama-3.2-1b-tiny")
    P.enable(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 512, (int(torch.randint(3, 40, (1,), generator=gen)),),
                                        generator=gen).tolist()} for _ in range(48)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             remove_unused_columns=False, logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=P.PackingCollator(max_length=96))
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed


def test_switches_and_auto_backend(monkeypatch):
    assert P.SWITCHES["packing_cache"].default is True
    assert P.SWITCHES["packing_backend"].choices == ("auto", "sdpa", "flex", "varlen", "off")
    monkeypatch.setenv("OPTIM_PACKING_BACKEND", "flex")
    monkeypatch.setenv("OPTIM_PACKING_CACHE", "off")
    assert P.SWITCHES["packing_backend"].resolve() == "flex"
    assert P.SWITCHES["packing_cache"].resolve() is False
    assert P.SWITCHES["packing_cache"].resolve(True) is True
    with pytest.raises(ValueError):
        P.SWITCHES["packing_backend"].resolve("xformers")
    assert P.resolve_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"


def test_auto_follows_the_measured_table_and_regional_tells_packing_the_layers_are_compiled():
    cuda = torch.device("cuda")
    assert P.AUTO_ON_CUDA == {True: "flex", False: "varlen"}
    assert P.resolve_backend("auto", cuda, torch.bfloat16, compiled=True) == "flex"
    eager = P.resolve_backend("auto", cuda, torch.bfloat16)
    assert eager == ("varlen" if P.varlen_available() else "flex")
    assert P.resolve_backend("auto", cuda, torch.float32) == "flex"  # varlen is fp16/bf16 only
    assert P.resolve_backend("varlen", cuda, torch.bfloat16, compiled=True) == "varlen"  # asked for
    from optim import regional

    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)
    P.enable(model)
    assert P.describe(model)["compiled_layers"] is False
    regional.enable(model, compile_layers=True)
    d = P.describe(model)
    assert d["compiled_layers"] is True and d["packing_backend_resolved"] == "sdpa"  # on CPU
    assert all(m._optim_packing.compiled for m in P._attention_modules(model))


def test_import_does_not_pull_in_harness():
    code = "import sys, optim.packing; assert 'harness' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(models.__file__).rsplit("/harness", 1)[0])


def _ref_scores(q, k, v, cu, scale, window):
    """Scores and the causal same-document (and window) mask of the varlen flash reference."""
    T, H, D = q.shape
    rep = H // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    doc = torch.bucketize(torch.arange(T), cu[1:].long(), right=True)
    i = torch.arange(T)
    ok = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    if "window_size_left" in window:
        ok &= (i[:, None] - i[None, :]) <= window["window_size_left"]
    return s, ok, kk, vv


def _ref_flash_forward(q, k, v, cu, _cu, max_q, _max_k, dropout, causal, debug, *, scale, **window):
    """Reference of aten._flash_attention_forward (varlen, causal, GQA): out, lse (H, T)."""
    s, ok, kk, vv = _ref_scores(q, k, v, cu, scale, window)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return out, lse, torch.zeros(2), torch.zeros(0), torch.zeros(0)


def _ref_flash_backward(g, q, k, v, out, lse, cu, _cu, mq, mk, dropout, causal, ra, rb, *, scale, **window):
    """Reference of aten._flash_attention_backward: P from (q, k, lse), D = rowsum(g * out)."""
    s, ok, kk, vv = _ref_scores(q, k, v, cu, scale, window)
    p = torch.exp(s.masked_fill(~ok, float("-inf")) - lse[..., None])
    dv = torch.einsum("hqk,qhd->khd", p, g)
    dp = torch.einsum("qhd,khd->hqk", g, vv)
    ds = p * (dp - (g * out).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    T, H, D = q.shape
    fold = lambda x: x.view(T, k.shape[1], H // k.shape[1], D).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("window", [None, 5])
def test_varlen_sink_backward_algebra(monkeypatch, window):
    """_FlashVarlen's sink handling (rescale by sigmoid(lse - sink), backward through the flash
    backward with grad_out = s*dy and out = y) gives the exact gradients of eager sink attention."""
    monkeypatch.setitem(PB._flash_ops, "forward", _ref_flash_forward)
    monkeypatch.setitem(PB._flash_ops, "backward", _ref_flash_backward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",
                        type("S", (), {"default": type("D", (), {"_schema": "window_size_left"})()})(),
                        raising=False)
    torch.manual_seed(0)
    T, H, Hkv, D = 20, 4, 2, 8
    q = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, Hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, Hkv, D, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
    left = -1 if window is None else window - 1
    out = PB._FlashVarlen.apply(q, k, v, sinks, cu, 11, 0.3, left)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    # eager reference: softmax over [scores, sink], drop the sink column
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
    doc = torch.bucketize(torch.arange(T), cu[1:].long(), right=True)
    i = torch.arange(T)
    ok = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        ok &= (i[:, None] - i[None, :]) < window
    s = s.masked_fill(~ok, float("-inf"))
    full = torch.cat([s, sinks.view(H, 1, 1).expand(H, T, 1)], -1).softmax(-1)[..., :-1]
    ref = torch.einsum("hqk,khd->qhd", full, vv)
    assert torch.allclose(out, ref, atol=1e-10)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-9), (a - b).abs().max()


# The fused flex path (CUDA) has a dynamo cache of its own and refuses to run flex_attention
# eagerly. Its mechanism is checked here with dynamo's eager backend (no kernel compile on 2
# cores, forward only); tests/test_gpu_packing.py checks the real kernel.


@pytest.fixture
def fresh_fused_flex(monkeypatch):
    monkeypatch.setattr(PB, "_FLEX_COMPILE_BACKEND", "eager")
    monkeypatch.setattr(PB, "_fused_flex_compiled", None)
    monkeypatch.setattr(PB, "_fused_flex_failed", None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _flex_inputs(T=128):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(3))
    meta = P.PackedMetadata.from_lengths([[T // 4, T - T // 4]])
    entry = P.build_entry(("test", T), meta, torch.device("cpu"))
    return q, k, v, P.build_flex_block_mask(entry, None), entry


def test_fused_flex_survives_a_full_flex_attention_cache(fresh_fused_flex):
    """transformers compiles flex_attention itself (dynamic=False: one cache entry per shape);
    every torch.compile(flex_attention) in a process shares that code object's cache. Once it is
    full, dynamo runs flex_attention eagerly, the unfused path. Ours compiles its own function,
    so it still compiles then, and computes what flex_attention computes."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    stock = torch.compile(flex_attention, backend="eager", dynamic=False)
    with torch.no_grad():
        for i in range(limit + 1):
            x = torch.randn(1, 2, 16 * (i + 1), 16)
            stock(x, x, x)
        assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == limit  # full
        q, k, v, bm, _ = _flex_inputs()
        # the old way, torch.compile(flex_attention), no longer compiles a new call, fullgraph
        # or not: dynamo runs it eagerly, and only torch's one-time warning says so
        torch.compile(flex_attention, backend="eager", fullgraph=True)(q, k, v, block_mask=bm)
        assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == limit
        res = PB._fused_flex(q, k, v, bm, 0.25, False, False)
        assert res is not None and P.fused_flex_failure() is None
        ref = flex_attention(q, k, v, block_mask=bm, scale=0.25)
    torch.testing.assert_close(res[0], ref)


def test_fused_flex_run_eagerly_is_refused(fresh_fused_flex):
    """If dynamo runs the body as plain Python, it stops before flex_attention would materialize
    the scores, the reason is kept, and without a varlen kernel the call refuses clearly."""
    q, k, v, bm, entry = _flex_inputs()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        assert PB._fused_flex(q, k, v, bm, 0.25, False, False) is None
    assert "eagerly" in P.fused_flex_failure()
    # sticky: the process does not try again (each try could compile for seconds)
    assert PB._fused_flex(q, k, v, bm, 0.25, False, False) is None
    with pytest.raises(P.FusedFlexUnavailable, match="fused kernel cannot run .*eagerly.*varlen"):
        PB._flex_stand_in(entry, q, k, v, 0.25, None, None, True)


def test_kernels_record_what_ran(built):
    model = built("llama-3.2-1b-tiny")
    ids = torch.randint(0, 512, (2, 100))
    meta = P.PackedMetadata.from_lengths(LENGTHS)
    for backend, kernel in (("sdpa", "sdpa-mask"), ("flex", "flex-unfused")):
        P.enable(model, packing_backend=backend)
        P.reset_counters()
        with torch.no_grad():
            model(input_ids=ids, position_ids=meta.position_ids(), use_cache=False, **P.packed_kwargs(meta))
        assert P.kernels() == {kernel: model.config.num_hidden_layers}, backend


def test_entry_from_position_ids_on_the_device_equals_the_host_built_entry():
    """What a CUDA-graph capture builds from position_ids (no sync, fixed shapes) against the entry
    built from the host lengths; varlen refuses it with the reason."""
    from optim.packing.metadata import entry_from_position_ids
    from optim.packing.structures import build_varlen_args

    meta = P.PackedMetadata.from_lengths([[3, 60, 1], [2, 62]])
    host = P.build_entry(("h",), meta, torch.device("cpu"))
    dev = entry_from_position_ids(("d",), meta.position_ids(), 2, 64, torch.device("cpu"))
    assert torch.equal(dev.start, host.start) and torch.equal(dev.doc, host.doc)
    for window in (None, 16):
        a, b = P.build_flex_block_mask(dev, window), P.build_flex_block_mask(host, window)
        assert torch.equal(a.kv_num_blocks, b.kv_num_blocks) and torch.equal(a.full_kv_num_blocks, b.full_kv_num_blocks)
    shared = entry_from_position_ids(("s",), meta.position_ids()[1:], 3, 64, torch.device("cpu"))  # (1, T) for all rows
    assert torch.equal(shared.start[2], host.start[1])
    with pytest.raises(ValueError, match="varlen kernel needs the batch's max_seqlen on the host"):
        build_varlen_args(dev)


def test_batches_collated_in_forked_dataloader_workers_never_share_a_cache_entry():
    """Two DataLoader workers forked from one process number their batches from the same counter:
    the metadata's serial must still tell their batches apart, or every second batch of an eval loop
    would run on the previous batch's documents. The losses match a loader without workers."""
    torch.manual_seed(0)
    m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4).eval()
    P.enable(m, packing_backend="sdpa")
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 100, (int(torch.randint(5, 60, (1,), generator=g)),),
                                            generator=g).tolist()} for _ in range(16)]

    def losses(workers):
        P.release()
        loader = torch.utils.data.DataLoader(examples, batch_size=4, num_workers=workers,
                                             collate_fn=P.PackingCollator(max_length=64, rows=4),
                                             multiprocessing_context="fork" if workers else None)
        out = []
        with torch.no_grad():
            for batch in loader:
                batch.pop("position_ids")  # the metadata alone: nothing else to tell the batches apart
                out.append(m(**batch, use_cache=False).loss)
        return torch.stack(out)

    alone = losses(0)
    assert len(set(alone.tolist())) == len(alone)  # the batches differ
    torch.testing.assert_close(losses(2), alone, rtol=0, atol=0)
