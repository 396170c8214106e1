"""What a user's model does after ``optim.enable`` beyond packed training: padded batches,
generate, a KV cache, turning it off, offload with the packing cache, the collator's row length,
and ``enabled()`` saying what ran. Each case against the same model never enabled."""

import copy
import dataclasses
import warnings

import pytest
import torch
from _lora import randomize_lora_b

import optim
from harness.workload import models
from optim import packing

DENSE = "qwen3-0.6b-tiny"
ALL = [DENSE, "llama-3.2-1b-tiny", "qwen3-30b-a3b-tiny", "gpt-oss-20b-tiny"]


def _pair(name, **enable):
    """A stock model and an enabled deep copy of it (same weights, LoRA B non-zero)."""
    spec = models.get(name)
    stock = randomize_lora_b(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4), seed=3)
    fast = optim.enable(copy.deepcopy(stock), **enable)
    return spec, stock, fast


def _padded(spec, side, B=3, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, spec.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for r, pad in enumerate([0, 5, 11][:B]):
        if side == "left" and pad:
            mask[r, :pad] = 0
        elif side == "right" and pad:
            mask[r, T - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    # a target counts where a real token predicts it: what a padding position predicts (a
    # left-padded row's first real token) has no stock value to match, stock's padding rows
    # seeing every key or none depending on its attention kernel
    from_real = torch.cat([torch.zeros(B, 1, dtype=torch.bool), mask[:, :-1].bool()], 1)
    labels = ids.masked_fill(~(mask.bool() & from_real), -100)
    return ids, mask, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("side", ["left", "right", "none"])
@pytest.mark.parametrize("name", ALL)
def test_a_padded_batch_matches_stock(name, side):
    """Real tokens' logits in eval, and loss and every LoRA gradient in training, equal stock's
    with the same attention_mask: left padding used to be read as one document per row."""
    spec, stock, fast = _pair(name)
    ids, mask, labels = _padded(spec, side)
    real = mask.bool()
    for m in (stock, fast):
        m.eval()
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    for m in (stock, fast):
        m.train()
    want = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    got = fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ref, mine = _grads(stock), _grads(fast)
    assert set(ref) == set(mine) and ref
    for n in ref:
        torch.testing.assert_close(mine[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)
    forwards = optim.enabled(fast)["optim.packing"]["forwards"]
    assert forwards["stock"] == 0 and forwards["padded_batches"] == (0 if side == "none" else 2)


def test_padding_between_real_tokens_is_refused_not_ignored():
    spec, _, fast = _pair(DENSE)
    ids = torch.randint(1, spec.vocab_size, (1, 8))
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 has padding between its real tokens"):
        fast(input_ids=ids, attention_mask=mask, use_cache=False)


def test_padding_and_packed_documents_together_are_refused():
    spec, _, fast = _pair(DENSE)
    meta = packing.PackedMetadata.from_lengths([[3, 5]])
    with pytest.raises(ValueError, match="attention_mask with padding and also packed documents"):
        fast(input_ids=torch.randint(1, spec.vocab_size, (1, 8)), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]),
             use_cache=False, **packing.packed_kwargs(meta))


@pytest.mark.parametrize("name", ALL)
def test_generate_gives_stocks_tokens(name):
    """Greedy generate, left-padded and unpadded, after enable (and after enable on a model in
    training mode): the same tokens as the model never enabled."""
    spec, stock, fast = _pair(name)
    ids, mask, _ = _padded(spec, "left", B=2, T=10, seed=1)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert fast.training  # generate() as called mid-training (no dropout here: the same tokens)
    assert torch.equal(fast.generate(input_ids=ids, attention_mask=mask, **kw),
                       stock.generate(input_ids=ids, attention_mask=mask, **kw))
    for m in (stock, fast):
        m.eval()
    want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = fast.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)
    want = stock.generate(input_ids=ids[:1, 4:], **kw)
    got = fast.generate(input_ids=ids[:1, 4:], **kw)
    assert torch.equal(got, want)
    assert optim.enabled(fast)["optim.packing"]["forwards"]["stock"] >= 12


def test_a_decoding_loop_with_a_kv_cache_runs_stock_attention():
    """A user's own loop: a prefill that returns the cache, then one token at a time with it."""
    spec, stock, fast = _pair(DENSE)
    ids = torch.randint(1, spec.vocab_size, (2, 9))
    from optim._hf import cache_kwarg, output_cache_field

    lm = stock.get_base_model()
    kw, field = cache_kwarg(type(lm).forward), output_cache_field(type(lm(input_ids=ids[:, :2])))
    outs = []
    for m in (stock, fast):
        m.eval()
        with torch.no_grad():
            out = m(input_ids=ids, use_cache=True)
            cache, logits = out[field], [out.logits[:, -1]]
            nxt = logits[-1].argmax(-1, keepdim=True)
            for _ in range(4):
                out = m(input_ids=nxt, use_cache=True, **{kw: cache})
                cache = out[field]
                logits.append(out.logits[:, -1])
                nxt = logits[-1].argmax(-1, keepdim=True)
        outs.append(torch.stack(logits))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("name", [DENSE, "gpt-oss-20b-tiny"])
def test_off_and_disable_give_the_stock_model_back(name):
    spec, stock, fast = _pair(name, offload="double", compile_layers=True)
    base = stock.get_base_model()
    hooks = _hooks(stock)
    ids, mask, labels = _padded(spec, "left")
    fast.eval()
    fast.generate(input_ids=ids[:, :6], max_new_tokens=2, do_sample=False, pad_token_id=0)
    fast.train()
    optim.enable(fast, packing_backend="off")
    assert fast.get_base_model().config._attn_implementation == base.config._attn_implementation
    assert "generate" not in vars(fast.get_base_model())
    assert "optim.packing" in optim.enabled(fast) and optim.enabled(fast)["optim.packing"] == {
        "resolved": {"packing_cache": True, "packing_backend": "off", "attention_split": False, "validate": True}}

    optim.disable(fast)
    assert optim.enabled(fast) == {}
    lm = fast.get_base_model()
    assert "forward" not in vars(lm) and "generate" not in vars(lm) and _hooks(fast) == hooks
    assert lm.config._attn_implementation == base.config._attn_implementation
    assert getattr(lm.config, "_experts_implementation", None) == getattr(base.config, "_experts_implementation", None)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in lm.modules())
    def flags(root):
        return [(n, getattr(m, "gradient_checkpointing", None), vars(m).get("_gradient_checkpointing_func"))
                for n, m in root.named_modules()]

    def same(a, b):  # transformers' checkpoint function is a partial, a new object per enable
        return getattr(a, "func", a) is getattr(b, "func", b) and getattr(a, "keywords", None) == getattr(b, "keywords", None)

    assert all(x[:2] == y[:2] and same(x[2], y[2]) for x, y in zip(flags(lm), flags(base)))
    assert [type(m) for m in fast.modules()] == [type(m) for m in stock.modules()]
    assert [p.requires_grad for p in fast.parameters()] == [p.requires_grad for p in stock.parameters()]
    want = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    got = fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert got.logits is not None  # the stock loss, which keeps the logits
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["single", "double"])
def test_offload_keeps_one_metadata_build_per_step(mode):
    """The forward under no_grad (offload's) must not hand the cache entry to the first recomputed
    layer, which released it after its own backward: every other layer rebuilt it."""
    spec = models.get("llama-3.2-1b-tiny")
    spec = dataclasses.replace(spec, name="llama-6-layers", num_hidden_layers=6)
    model = randomize_lora_b(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4))
    optim.enable(model, offload=mode)
    from optim import offload

    meta = packing.PackedMetadata.from_lengths([[7, 20, 5], [32]])
    ids = torch.randint(1, spec.vocab_size, (2, 32))
    for step in range(3):
        packing.reset_counters()
        out = model(input_ids=ids, labels=ids, use_cache=False, **packing.packed_kwargs(meta))
        out.loss.backward()
        c = packing.counters()
        assert c["metadata"] == 1 and c["sdpa_mask"] == 1 and c["releases"] == 1, (step, c)
        assert packing.cached_entry("cpu") is None
        meta = packing.PackedMetadata.from_lengths([[7, 20, 5], [32]])  # a new batch each step
    assert offload.get(model).stats()["layers"] == 6


def test_packing_kwarg_without_position_ids_restarts_positions():
    """``model(input_ids=..., packing=meta)``: the positions come from the documents (they used to
    be 0..T-1 across the row, then refused as disagreeing with an argument never passed)."""
    spec, _, fast = _pair(DENSE)
    meta = packing.PackedMetadata.from_lengths([[5, 9, 2]])
    ids = torch.randint(1, spec.vocab_size, (1, 16))
    fast.eval()
    with torch.no_grad():
        a = fast(input_ids=ids, use_cache=False, **packing.packed_kwargs(meta)).logits
        b = fast(input_ids=ids, position_ids=meta.position_ids(), use_cache=False, **packing.packed_kwargs(meta)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_collator_packs_to_the_longest_row():
    ex = [{"input_ids": [5, 6, 7]}, {"input_ids": list(range(10, 40))}, {"input_ids": [1, 2]}]
    batch = packing.PackingCollator(max_length=34)(ex)
    assert batch["input_ids"].shape == (2, 33) and batch["packing"].lengths == ((3, 30), (2, 31))
    assert packing.PackingCollator(max_length=34, pad_to_multiple_of=8)(ex)["input_ids"].shape == (2, 40)
    assert packing.PackingCollator(max_length=34, pad_to_max_length=True)(ex)["input_ids"].shape == (2, 34)
    assert packing.PackingCollator()(ex)["input_ids"].shape == (1, 35)
    for bad in (dict(max_length=8.0), dict(max_length=0), dict(max_length=-4), dict(pad_to_multiple_of=-8),
                dict(rows=0, max_length=8), dict(max_length=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            packing.PackingCollator(**bad)


def test_lengths_must_be_ints():
    with pytest.raises(TypeError, match="must be an int, got 3.7"):
        packing.PackedMetadata.from_lengths([[3.7, 4.3]])
    with pytest.raises(TypeError, match="must be an int, got '3'"):
        packing.PackedMetadata.from_lengths([["3", 4]])
    with pytest.raises(TypeError, match="seq_len must be an int"):
        packing.PackedMetadata.from_lengths([[3, 4]], seq_len=7.9)
    assert packing.PackedMetadata.from_lengths(torch.tensor([[3, 4]])).lengths == ((3, 4),)


def test_no_deprecated_cache_keyword_on_the_hot_path():
    spec, _, fast = _pair(DENSE)
    ids = torch.randint(1, spec.vocab_size, (1, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        fast.eval()
        fast(input_ids=ids, labels=ids, use_cache=False)
        fast.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    said = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not said, said


def test_enabled_reports_the_loss_that_ran():
    """A caller with its own fused lm_head (TRL passes fused_lm_head=True) computes the loss
    itself: enabled() must not claim the fused loss ran."""
    spec, _, fast = _pair(DENSE)
    lm = fast.get_base_model()
    ids = torch.randint(1, spec.vocab_size, (1, 12))
    assert optim.enabled(fast)["optim.loss"]["fused_loss"] is True  # nothing ran yet
    fast(input_ids=ids, labels=ids, use_cache=False)
    assert optim.enabled(fast)["optim.loss"]["loss_calls"] == {"fused": 1}
    vars(lm)["_optim_loss_paths"].clear()
    stock_forward = vars(lm)["_optim_loss_forward"]
    vars(lm)["_optim_loss_forward"] = lambda **kw: stock_forward(**{k: v for k, v in kw.items() if k != "fused_lm_head"})
    fast(input_ids=ids, labels=ids, use_cache=False, fused_lm_head=True)
    got = optim.enabled(fast)["optim.loss"]
    assert got["fused_loss"] is False and "TRL" in got["fused_loss_bypassed"], got


def test_enable_disable_enable_cycles_leave_nothing_behind():
    spec, stock, fast = _pair(DENSE, offload="double")
    hooks = _hooks(stock)
    ids, mask, labels = _padded(spec, "right")
    for _ in range(3):
        optim.disable(fast)
        assert _hooks(fast) == hooks and optim.enabled(fast) == {}
        optim.enable(fast, offload="single")
        fast(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert optim.enabled(fast)["optim.packing"]["forwards"]["padded_batches"] == 1


def test_disable_through_either_wrapper_finds_the_same_state():
    """enable on the bare model, wrap it in peft, enable and disable through the wrapper."""
    from peft import get_peft_model

    spec = models.get(DENSE)
    bare = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=None)
    impl = bare.config._attn_implementation
    optim.enable(bare)
    wrapped = get_peft_model(bare, models.lora_config(spec, 4))
    optim.enable(wrapped)
    optim.disable(wrapped)
    assert bare.config._attn_implementation == impl and optim.enabled(bare) == {} and optim.enabled(wrapped) == {}
    assert not any(k.startswith("_optim") for m in wrapped.modules() for k in vars(m)), \
        sorted({k for m in wrapped.modules() for k in vars(m) if k.startswith("_optim")})


def test_a_custom_generate_on_the_instance_runs_with_the_stock_attention_and_comes_back_on_disable():
    """transformers sets a repo's custom_generate on the model instance (``self.generate =
    partial(custom, model=self)``): enable keeps it, running it inside the stock attention as the
    class's generate runs, and disable puts the same object back."""
    import functools

    spec = models.get(DENSE)
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    lm = model.get_base_model()
    stock_impl = lm.config._attn_implementation
    seen = []

    def custom_generate(*args, model, **kwargs):
        seen.append(model.config._attn_implementation)
        return type(model).generate(model, *args, **kwargs)

    own = functools.partial(custom_generate, model=lm)
    lm.generate = own
    optim.enable(model)
    assert lm.config._attn_implementation != stock_impl  # packed outside generate
    ids = torch.randint(1, spec.vocab_size, (1, 8))
    model.eval()
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11) and seen == [stock_impl]
    optim.disable(model)
    assert vars(lm)["generate"] is own
    assert not any(k.startswith("_optim") for m in model.modules() for k in vars(m))


def test_a_deep_copy_routes_its_own_calls():
    """A reference model (TRL's create_reference_model) or an EMA copy is a deep copy: its
    generate and forwards must run its own weights and count on its own route."""
    spec, _, fast = _pair(DENSE)
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1.5)
    ids = torch.randint(1, spec.vocab_size, (1, 8))
    fast.eval()
    twin.eval()
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    a, b = fast.generate(input_ids=ids, **kw), twin.generate(input_ids=ids, **kw)
    assert not torch.equal(a, b)
    fresh = copy.deepcopy(twin)
    optim.disable(fresh)
    assert torch.equal(fresh.generate(input_ids=ids, **kw), b)  # the copy's weights, stock attention
    assert optim.enabled(twin)["optim.packing"]["forwards"]["stock"] >= 5
    assert optim.enabled(fast)["optim.packing"]["forwards"]["stock"] == optim.enabled(twin)["optim.packing"]["forwards"]["stock"]


def test_an_interrupted_generate_leaves_the_model_packed():
    """Ctrl-C inside generate(): the next training call still runs the packed attention."""
    spec, _, fast = _pair(DENSE)
    lm = fast.get_base_model()
    calls = {"n": 0}

    def interrupt(module, args, output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    handle = lm.model.layers[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        fast.generate(input_ids=torch.randint(1, spec.vocab_size, (1, 6)), max_new_tokens=4, do_sample=False,
                      pad_token_id=0)
    handle.remove()
    assert not packing.in_stock_mode() and lm.config._attn_implementation == packing.ATTN_NAME
    before = optim.enabled(fast)["optim.packing"]["forwards"]["packed"]
    meta = packing.PackedMetadata.from_lengths([[5, 9]])
    fast(input_ids=torch.randint(1, spec.vocab_size, (1, 14)), use_cache=False, **packing.packed_kwargs(meta))
    assert optim.enabled(fast)["optim.packing"]["forwards"]["packed"] == before + 1


def test_a_stock_call_in_training_recomputes_as_stock():
    """A training forward with a 4-D mask runs stock; checkpointing recomputes it after the stock
    call has ended, and the recompute must run stock too, with that mask."""
    spec, stock, fast = _pair(DENSE, offload="double")
    ids = torch.randint(1, spec.vocab_size, (1, 10))
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    mask[6:, :6] = False  # two documents, as a 4-D mask of the caller's making
    grads = []
    for m in (stock, fast):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids, attention_mask=mask[None, None], use_cache=False).loss.backward()
        grads.append(_grads(m))
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_reference_models_no_grad_pass_does_not_keep_the_cache_alive():
    """DPO's pattern: a frozen reference model under no_grad, then the policy with grad, on the
    same packed batch. The policy's first layer releases the cached structures after its backward."""
    spec, ref, policy = _pair(DENSE)
    optim.enable(ref)
    meta = packing.PackedMetadata.from_lengths([[7, 9], [16]])
    ids = torch.randint(1, spec.vocab_size, (2, 16))
    with torch.no_grad():
        ref(input_ids=ids, labels=ids, use_cache=False, **packing.packed_kwargs(meta))
    policy(input_ids=ids, labels=ids, use_cache=False, **packing.packed_kwargs(meta)).loss.backward()
    assert packing.cached_entry("cpu") is None


def test_offload_none_by_name_turns_offload_off():
    spec, stock, fast = _pair(DENSE, offload="double")
    from optim import offload

    assert offload.get(fast) is not None
    optim.enable(fast, offload="none")
    assert offload.get(fast) is None and "optim.offload" not in optim.enabled(fast)


def test_from_attention_mask_gives_each_rows_runs():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    meta = packing.PackedMetadata.from_attention_mask(mask)
    assert meta.lengths == ((2, 3), (3, 2), (5,)) and meta.source == "attention_mask"
    assert packing.PackedMetadata.from_attention_mask(torch.ones(2, 5)) is None


def test_a_mask_passed_positionally_to_the_stack_is_honoured():
    """model.model(input_ids, attention_mask, ...) by position, as some callers do."""
    spec, stock, fast = _pair(DENSE)
    ids, mask, _ = _padded(spec, "left")
    outs = []
    for m in (stock, fast):
        m.eval()
        with torch.no_grad():
            outs.append(m.get_base_model().model(ids, mask).last_hidden_state)
    real = mask.bool()
    torch.testing.assert_close(outs[1][real], outs[0][real], rtol=1e-4, atol=1e-5)
