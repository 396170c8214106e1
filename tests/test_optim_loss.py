"""optim.loss: the chunked linear + cross-entropy equals transformers' loss and gradients, through
model(..., labels=...) once enabled, with and without num_items_in_batch and shift_labels."""

import pytest
import torch
from _lora import randomize_lora_b

import optim
import optim.loss as L
from harness.workload import models


def _stock_ce(hidden, weight, labels, num_items=None):
    logits = (hidden @ weight.t()).float()
    s = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                          ignore_index=-100, reduction="sum")
    return s / (num_items if num_items is not None else (labels != -100).sum())


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [64, 1000])
def test_loss_and_both_gradients_match_the_full_logits(dtype, chunk, kernel):
    g = torch.Generator().manual_seed(0)
    N, H, V = 301, 32, 517  # a last chunk shorter than the rest, a vocabulary not a power of two
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.2).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    ref = _stock_ce(hidden, weight, labels)
    ref.backward(torch.tensor(0.5))
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = L.linear_cross_entropy(hidden, weight, labels, chunk=chunk, kernel=kernel)
    got.backward(torch.tensor(0.5))
    assert L._compiled_chunk.failed is None
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, ref.float(), **tol)
    torch.testing.assert_close(hidden.grad, ref_h, **tol)
    torch.testing.assert_close(weight.grad, ref_w, **tol)
    assert weight.grad.dtype == dtype


def test_a_compiler_failure_runs_the_chunk_eager_with_one_warning(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("inductor could not build this")

    chunk = L._CompiledChunk()
    chunk.fn = broken
    monkeypatch.setattr(L, "_compiled_chunk", chunk)
    hidden = torch.randn(50, 8, requires_grad=True)
    weight = torch.randn(13, 8)
    labels = torch.randint(0, 13, (50,))
    with caplog.at_level("WARNING", logger="optim.loss"):
        got = L.linear_cross_entropy(hidden, weight, labels, chunk=16, kernel="compiled")
    torch.testing.assert_close(got, _stock_ce(hidden, weight, labels))
    assert chunk.failed.startswith("RuntimeError: inductor could not build this")
    assert len([r for r in caplog.records if "failed" in r.message]) == 1


def test_loss_kernel_is_checked_and_described():
    with pytest.raises(ValueError, match="loss_kernel='fast' is not valid"):
        L.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long), kernel="fast")
    with pytest.raises(ValueError, match="cut-cross-entropy runs on CUDA only"):
        L.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long), kernel="cce")
    assert L.resolve_kernel("auto", torch.device("cpu")) == "eager"
    assert L.resolve_kernel("auto", torch.device("cuda")) == "compiled"
    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4)
    L.enable(model)
    assert L.describe(model)["loss_kernel"] == "eager"
    L.enable(model, loss_kernel="compiled")  # a later call changes the kernel of the patched model
    assert L.describe(model)["loss_kernel"] == "compiled"
    with pytest.raises(ValueError, match="CUDA only"):
        L.enable(model, loss_kernel="cce")


def test_a_second_backward_is_refused_with_the_reason():
    hidden = torch.randn(10, 8, requires_grad=True)
    loss = L.linear_cross_entropy(hidden, torch.randn(11, 8), torch.randint(0, 11, (10,)))
    (loss * 2).backward(retain_graph=True)
    first = hidden.grad.clone()
    with pytest.raises(RuntimeError, match="second backward through the fused loss"):
        loss.backward()
    torch.testing.assert_close(first, hidden.grad)  # the first one stands


def test_num_items_divides_and_all_ignored_is_zero():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    labels = torch.randint(0, 11, (10,))
    torch.testing.assert_close(L.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=40),
                               _stock_ce(hidden, weight, labels, 40))
    none = L.linear_cross_entropy(hidden, weight, torch.full((10,), -100))
    none.backward()
    assert none.item() == 0.0 and hidden.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="10 hidden rows but 9 labels"):
        L.linear_cross_entropy(hidden, weight, labels[:9])


def test_a_data_parallel_replicas_count_is_one_count_and_two_counts_are_refused():
    # Trainer under nn.DataParallel (several GPUs visible, no launcher) hands each replica its
    # num_items_in_batch as a (1, 1) tensor: the same loss and gradients as the 0-d count
    weight = torch.randn(11, 8)
    labels = torch.randint(0, 11, (10,))
    grads = []
    for count in (torch.tensor(40), torch.tensor([[40]]), torch.tensor([40.0])):
        hidden = torch.ones(10, 8).mul_(0.3).requires_grad_()
        loss = L.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=count)
        loss.backward()
        assert loss.shape == ()
        torch.testing.assert_close(loss, _stock_ce(hidden, weight, labels, 40))
        grads.append(hidden.grad)
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])
    with pytest.raises(ValueError, match=r"must hold one count, got shape \(2, 1\)"):
        L.linear_cross_entropy(torch.randn(10, 8), weight, labels, num_items_in_batch=torch.tensor([[40], [40]]))


def test_chunk_size_keeps_the_logits_bounded():
    assert L.chunk_tokens(151936) == 256  # 256 MiB of fp32 logits per chunk
    assert L.chunk_tokens(32) == 1 << 21 and L.chunk_tokens(10**9) == 64


@pytest.mark.parametrize("name", ["qwen3-0.6b-tiny", "gpt-oss-20b-tiny"])
def test_enabled_model_gives_stock_loss_and_grads_at_every_step(name):
    from harness.run.experiment import DataSpec
    from harness.workload.data import make_batch

    spec = models.get(name)

    def build():
        m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
        return randomize_lora_b(m, seed=1)

    stock, fused = build(), optim.enable(build(), only=("loss",))
    assert optim.enabled(fused)["optim.loss"]["fused_loss"] is True
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (stock, fused)]
    for step in range(3):  # the first step and later ones, weights moving
        batch = make_batch(DataSpec(median_doc_len=20, seed=step), 64, 2, spec.vocab_size)
        kw = dict(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, use_cache=False)
        outs = []
        for m, opt in zip((stock, fused), opts):
            opt.zero_grad()
            out = m(**kw, num_items_in_batch=torch.tensor(100)) if step == 2 else m(**kw)
            out.loss.backward()
            outs.append((out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
            opt.step()
        (ref, ref_g), (got, got_g) = outs
        assert got.logits is None and ref.logits is not None
        torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
        assert set(got_g) == set(ref_g)
        for n in ref_g:
            torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-4, atol=1e-6, msg=f"step {step}: {n}")

    fused.eval()  # eval keeps the logits (metrics need them)
    with torch.no_grad():
        out = fused(**kw)
    assert out.logits is not None and out.loss is not None


def test_shift_labels_and_disable():
    spec = models.get("qwen3-0.6b-tiny")
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    ids = torch.randint(0, spec.vocab_size, (1, 16))
    labels = ids.clone()
    stock = model(input_ids=ids, labels=labels, use_cache=False).loss
    L.enable(model)
    L.enable(model)  # idempotent
    shifted = L.shift_labels(labels)
    got = model(input_ids=ids, labels=labels, shift_labels=shifted, use_cache=False)
    torch.testing.assert_close(got.loss, stock)
    L.enable(model, fused_loss=False)
    assert model(input_ids=ids, labels=labels, use_cache=False).logits is not None


def test_an_adapter_on_lm_head_keeps_the_stock_loss(caplog):
    import peft

    spec = models.get("qwen3-0.6b-tiny")
    base = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with caplog.at_level("INFO", logger="optim.loss"):
        L.enable(model)
    assert "keeping the stock loss" in caplog.text and not L.describe(model)["fused_loss"]


def test_a_model_whose_logits_are_more_than_lm_head_keeps_its_own_loss(caplog):
    """Granite divides its logits by logits_scaling; a model of the user's own may scale them under
    any name. The fused loss computes lm_head(hidden) alone, so such a model keeps its stock loss,
    and the loss it trains on is the model's own."""
    import transformers

    class Tempered(transformers.Qwen3ForCausalLM):  # a user's model: its logits at a temperature
        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, **kwargs)
            logits = out.logits / 2.0
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, logits_scaling=8.0))
    tempered = Tempered(models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32,
                                     lora_rank=0).config)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for model, why in ((granite, "logits_scaling"), (tempered, "logits = out.logits / 2.0")):
        model.train()
        stock = model(input_ids=ids, labels=ids).loss
        caplog.clear()
        with caplog.at_level("INFO", logger="optim.loss"):
            L.enable(model)
        assert not L.describe(model)["fused_loss"] and "keeping the stock loss" in caplog.text and why in caplog.text, \
            caplog.text
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, stock)
    assert L.logits_beyond_lm_head(transformers.Qwen3ForCausalLM) is None  # the models it is for stay fused


def test_under_autocast_the_stock_loss_runs_and_says_why():
    """Trainer's bf16=True over fp32 weights: autocast decides lm_head's dtype, which the fused loss
    would not follow (it failed on the dtype of its output); that call runs the model's own loss."""
    torch.manual_seed(0)
    model = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4).train()
    randomize_lora_b(model)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    stock_loss, stock_grads = step()
    L.enable(model, fused_loss=True)
    loss, grads = step()
    torch.testing.assert_close(loss, stock_loss, rtol=0, atol=0)
    assert grads.keys() == stock_grads.keys() and all(torch.equal(grads[n], stock_grads[n]) for n in grads)
    assert any("autocast" in why for why in L.describe(model)["loss_calls"]), L.describe(model)


def test_under_autocast_to_lm_heads_dtype_the_fused_loss_runs_at_every_step():
    """Trainer's ``bf16=True`` over a bf16 model: autocast would compute lm_head in its own dtype,
    so the fused loss runs (autocast off inside), and its loss and gradients stay within bf16
    tolerance of the stock loss under the same autocast, step after step."""
    def build():
        torch.manual_seed(0)
        m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.bfloat16, lora_rank=4).train()
        return randomize_lora_b(m)

    batches = [torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def run(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        out = []
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            out.append((loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
            opt.step()
        return out

    stock = run(build())
    model = L.enable(build(), fused_loss=True)
    fused = run(model)
    assert L.describe(model)["loss_calls"] == {"fused": 3}, L.describe(model)
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(fused, stock)):
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-3, msg=f"step {step}")
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            assert ((grads[n] - g).abs().max() / g.abs().max()).item() < 0.05, (step, n)
