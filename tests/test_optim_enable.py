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


@pytest.mark.parametrize("name", ["qwen3-0.6b-tiny", "qwen3-30b-a3b-tiny"])
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
    assert "moe_backend" in optim.SWITCHES and "offload" in optim.SWITCHES


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
