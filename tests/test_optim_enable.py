"""optim.enable: one call turns every optimization on for a user's model, numerics unchanged."""

import pytest
import torch
from _lora import randomize_lora_b

import optim
from harness.workload import models
from optim import packing


def _step(model, batch, meta=None):
    kwargs = packing.packed_kwargs(meta) if meta is not None else {}
    out = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                use_cache=False, **kwargs)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("name", ["qwen3-0.6b-tiny", "qwen3-8b-yarn-tiny", "llama-3.1-8b-tiny", "qwen3-30b-a3b-tiny"])
def test_one_call_keeps_loss_and_grads(name):
    from harness.run.experiment import DataSpec
    from harness.workload.data import make_batch

    spec = models.get(name)
    batch = make_batch(DataSpec(median_doc_len=20), 96, 2, spec.vocab_size)
    meta = packing.PackedMetadata.from_lengths(batch.lengths)

    def build():
        m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
        return randomize_lora_b(m, seed=3)

    stock = build()
    ref_loss = _step(stock, batch)
    ref = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}

    fast = optim.enable(build(), offload="double")
    assert fast.base_model.model.config._attn_implementation == packing.ATTN_NAME
    loss = _step(fast, batch, meta)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    got = {n: p.grad for n, p in fast.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_unknown_switch_is_refused():
    with pytest.raises(ValueError, match="unknown optim switch.*valid: .*packing_cache"):
        optim.enable(torch.nn.Linear(2, 2), packing_cahce=False)
    with pytest.raises(TypeError, match=r"got a DataParallel: enable the model it wraps \(optim.enable\(model.module\)"):
        optim.enable(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    assert "moe_backend" in optim.SWITCHES and "offload" in optim.SWITCHES


def test_an_invalid_environment_value_is_named_and_leaves_the_model_as_it_was(monkeypatch):
    """OPTIM_COMPILE_LAYERS set to nonsense: one error that names the variable, raised before any
    module changed the model (no attention swapped, no loss patched, nothing to disable)."""
    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4)
    attention = model.config._attn_implementation
    from optim import loss as optim_loss

    forward = type(optim_loss.causal_lm(model)).forward
    monkeypatch.setenv("OPTIM_COMPILE_LAYERS", "yes please")
    with pytest.raises(ValueError, match="from the environment variable OPTIM_COMPILE_LAYERS"):
        optim.enable(model)
    assert model.config._attn_implementation == attention and optim.enabled(model) == {}
    lm = optim_loss.causal_lm(model)
    assert "forward" not in vars(lm) and type(lm).forward is forward  # the stock loss, untouched


def test_data_parallel_of_an_enabled_model_is_refused_with_the_way_out_and_disable_lifts_it():
    # nn.DataParallel (what Trainer does with several GPUs and no launcher) replicates every module
    # through _replicate_for_data_parallel: its replicas would call the forwards optim bound
    import copy

    from optim import loss

    def replicate(model):
        return [m._replicate_for_data_parallel() for m in model.modules()]

    def build():
        return models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2)

    model = build()
    assert all(r._is_replica for r in replicate(model))  # stock replicates
    optim.enable(model)
    for m in (model, copy.deepcopy(model)):  # a deep copy refuses too
        with pytest.raises(RuntimeError, match="DataParallel is not supported.*torchrun or accelerate") as err:
            replicate(m)
        assert str(err.value) == optim.DATA_PARALLEL
    optim.disable(model)
    assert all(r._is_replica for r in replicate(model))
    # a module enabled by itself refuses where it binds a forward, and its disable lifts that
    loss.enable(model)
    with pytest.raises(RuntimeError, match="DataParallel is not supported"):
        replicate(model)
    loss.disable(model)
    assert all(r._is_replica for r in replicate(model))
    # nothing applied, nothing refused
    optim.enable(model, only=())
    assert optim.enabled(model) == {} and all(r._is_replica for r in replicate(model))


def test_the_harness_trainer_runs_keep_to_one_gpu_unless_asked_for_data_parallel():
    from types import SimpleNamespace

    from harness.workload.trainers import _one_device

    assert _one_device(SimpleNamespace(n_gpu=2, _n_gpu=2), data_parallel=False)._n_gpu == 1
    assert _one_device(SimpleNamespace(n_gpu=2, _n_gpu=2), data_parallel=True)._n_gpu == 2
    assert _one_device(SimpleNamespace(n_gpu=0, _n_gpu=0), data_parallel=False)._n_gpu == 0


def test_only_applies_the_named_modules_as_asked():
    spec = models.get("qwen3-0.6b-tiny")
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    optim.enable(model, only=("offload",), offload="none")
    got = optim.enabled(model)
    # named explicitly, "none" still routes checkpointing through the offloader; nothing else ran
    assert list(got) == ["optim.offload"] and got["optim.offload"]["resolved"]["offload"] == "none"
    from optim import offload
    assert offload.get(model) is not None
    assert model.base_model.model.config._attn_implementation != packing.ATTN_NAME

    plain = optim.enable(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4), offload="none")
    assert "optim.offload" not in optim.enabled(plain) and offload.get(plain) is None
    assert list(optim.enabled(plain))[0] == "optim.packing"


def test_only_refuses_unknown_modules_and_foreign_switches():
    with pytest.raises(ValueError, match="unknown optim module"):
        optim.enable(torch.nn.Linear(2, 2), only=("pakcing",))
    with pytest.raises(ValueError, match="outside only"):
        optim.enable(torch.nn.Linear(2, 2), only=("packing",), offload="double")



def _documents_alone(model, batch):
    """The reference: stock, each document in its own forward; the loss is the same mean over
    every predicted token (a document's first token is never a target)."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    for r, row in enumerate(batch.lengths):
        s = 0
        for n in row:
            x = batch.input_ids[r, s:s + n]
            logits = model(input_ids=x[None], position_ids=torch.arange(n)[None], use_cache=False).logits[0]
            total = total + F.cross_entropy(logits[:-1].float(), x[1:], reduction="sum")
            count += n - 1
            s += n
    loss = total / count
    loss.backward()
    return loss.detach()


def _train(model, batches, step):
    """A user's own loop: AdamW, one packed batch per step. Per step: the loss and the LoRA
    gradients."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = step(model, batch)
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
    return out


@pytest.mark.slow
def test_every_step_of_a_users_loop_matches_documents_alone_then_a_second_model():
    """The defaults a user gets, in their own loop, fed only position_ids (as
    DataCollatorWithFlattening gives them): every step matches each document run alone, the first
    included, then with the weights moving and each batch's document lengths different. Then a
    second model, of another architecture (sinks, sliding windows, MoE), in the same process: the
    per-process state (the metadata cache, the compiled chunk) must not leak from the first."""
    from harness.run.experiment import DataSpec
    from harness.workload.data import make_batch

    for name in ("qwen3-0.6b-tiny", "gpt-oss-20b-tiny"):
        spec = models.get(name)
        batches = [make_batch(DataSpec(median_doc_len=24, seed=s), 96, 2, spec.vocab_size) for s in range(3)]
        assert len({str(b.lengths) for b in batches}) == 3  # the lengths change every step

        def build():
            return randomize_lora_b(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4), seed=3)

        ref = _train(build(), batches, _documents_alone)
        got = _train(optim.enable(build()), batches, _step)
        assert len(got) == len(ref) == 3
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, ref)):
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"{name} step {step} loss")
            assert set(grads) == set(ref_grads) and ref_grads
            for n in ref_grads:
                torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6,
                                           msg=f"{name} step {step} {n}")


def _worst_error_per_document(model, ids, lengths):
    """Per document of one packed row: the largest logit difference against the document alone."""
    model.eval()
    pos = packing.PackedMetadata.from_lengths([lengths]).position_ids()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        errs, s = [], 0
        for n in lengths:
            alone = model(input_ids=ids[:, s:s + n], position_ids=torch.arange(n)[None], use_cache=False).logits[0]
            errs.append(float((packed[s:s + n] - alone).abs().max()))
            s += n
    return errs


def test_stock_gpt_oss_attends_across_packed_documents_where_enable_and_stock_qwen3_llama_do_not():
    """transformers builds gpt-oss's masks without position_ids (checked in 5.17 and 5.23), so a
    packed row's later documents attend to the earlier ones; stock Qwen3 and Llama keep them
    apart. The report says so beside every gpt-oss peer figure: this test tells when it changes."""
    import transformers

    lengths = [18, 30, 48]
    for name in ("gpt-oss-20b-tiny", "qwen3-0.6b-tiny", "llama-3.2-1b-tiny"):
        spec = models.get(name)
        ids = torch.randint(0, spec.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
        build = lambda: randomize_lora_b(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4), seed=3)  # noqa: E731
        stock = _worst_error_per_document(build(), ids, lengths)
        assert stock[0] < 1e-5, name  # the first document has nothing before it to see
        if name.startswith("gpt-oss"):
            assert min(stock[1:]) > 1e-2, (
                f"transformers {transformers.__version__} keeps gpt-oss's packed documents apart now: "
                "drop the caveat of harness/report/blog/common.stock_caveats and optim.packing.STOCK_MIXES_DOCUMENTS")
        else:
            assert max(stock) < 1e-4, (name, stock)
        assert max(_worst_error_per_document(optim.enable(build()), ids, lengths)) < 1e-4, name


def test_packing_off_on_gpt_oss_says_its_documents_mix(caplog):
    for name, warns in (("gpt-oss-20b-tiny", True), ("qwen3-0.6b-tiny", False)):
        model = models.build(models.get(name), device="cpu", dtype=torch.float32, lora_rank=4)
        caplog.clear()
        with caplog.at_level("WARNING", logger="optim.packing"):
            optim.enable(model, only=("packing",), packing_backend="off")
        lines = [r.getMessage() for r in caplog.records]
        assert bool(lines) == warns, (name, lines)
        if warns:
            assert "packing_backend='off' keeps stock gpt_oss attention" in lines[0]
            assert "position_ids" in lines[0]
