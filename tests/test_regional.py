"""optim.regional on CPU (fp32): compiled decoder layers give the eager loss and LoRA gradients,
with packed attention and a MoE block kept eager behind graph breaks, one graph for every batch,
and a compiler failure that falls back to eager once. Each test compiles: kept to tiny models."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from _lora import randomize_lora_b
from _packed_step import assert_same_step as _assert_same, packed_step as _step

import optim
import optim.moe as M
import optim.packing as P
import optim.regional as R
from harness.workload import models

LENGTHS = [[[37, 50, 13], [100]], [[60, 40], [30, 70]], [[100], [1] * 100]]


def _build(name, compile_layers, moe_backend=None):
    model = models.build(models.get(name), device="cpu", dtype=torch.float32, lora_rank=4)
    randomize_lora_b(model)
    P.enable(model, packing_backend="sdpa")
    if moe_backend:
        M.enable(model, moe_backend=moe_backend)
    R.enable(model, compile_layers=compile_layers)
    return model


@pytest.mark.parametrize("name, moe_backend", [("qwen3-0.6b-tiny", None), ("gpt-oss-20b-tiny", "sorted")])
def test_compiled_layers_match_eager(name, moe_backend):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    eager, comp = _build(name, False, moe_backend), _build(name, True, moe_backend)
    for lengths in LENGTHS:  # new documents every batch, same graph
        _assert_same(_step(eager, lengths), _step(comp, lengths))
    d = R.describe(comp)
    n = len(R.decoder_layers(comp))
    # every layer body compiled, in the forward and in the recompute (2 calls per layer and batch),
    # whether transformers checkpoints the layer call (< 5.23) or forward() inside it (>= 5.23)
    calls = d["layer_calls"]
    assert d["compiled_layers"] == n and calls["eager"] == 0
    assert calls["compiled"] == 2 * n * len(LENGTHS), calls
    assert "compile_error" not in d and R.describe(eager)["compiled_layers"] == 0
    assert d["eager_moe_blocks"] == (n if moe_backend else 0)
    assert not counters["recompiles"], dict(counters["recompiles"])  # the metadata is not guarded on
    # one graph for every layer: nothing guards on a layer's index (8 layers would hit dynamo's
    # recompile limit; the H100 did with a layer_idx guard)
    assert _graphs_per_layer_code(comp) == 1


def _graphs_per_layer_code(model) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = R.layer_codes(R.decoder_layers(model)[0]) | {torch.nn.Module._call_impl.__code__}
    return max(len(_debug_get_cache_entry_list(c)) for c in codes)


def test_compiler_failure_falls_back_to_eager_once(caplog):
    eager, comp = _build("qwen3-0.6b-tiny", False), _build("qwen3-0.6b-tiny", True)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no kernel for you")

    for layer in R.decoder_layers(comp):
        layer._compiled_call_impl.compiled = broken
        layer._compiled_call_impl.body_compiled = broken  # transformers >= 5.23: the checkpointed body
    with caplog.at_level(logging.WARNING, logger="optim.regional"):
        for lengths in LENGTHS[:2]:
            _assert_same(_step(eager, lengths), _step(comp, lengths))
    d = R.describe(comp)
    assert d["compile_error"] == "RuntimeError: inductor: no kernel for you"
    assert d["layer_calls"]["compiled"] == 0
    assert sum("failed" in r.message for r in caplog.records) == 1


def test_bad_input_raises_as_eager_and_keeps_compiling():
    comp = _build("qwen3-0.6b-tiny", True)
    meta = P.PackedMetadata.from_lengths([[30, 70]])
    ids = torch.randint(0, 100, (1, 80))  # the metadata describes 100 tokens
    with pytest.raises(ValueError, match="100 tokens"):
        comp(input_ids=ids, labels=ids, **P.packed_kwargs(meta))
    assert "compile_error" not in R.describe(comp)


def test_switch_resolution(monkeypatch):
    m = _build("qwen3-0.6b-tiny", "auto")  # auto: on CUDA only
    assert R.describe(m)["compiled_layers"] == 0
    monkeypatch.setenv("OPTIM_COMPILE_LAYERS", "on")
    m = models.build(models.get("llama-3.2-1b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4)
    optim.enable(m)
    assert R.describe(m)["compiled_layers"] == len(R.decoder_layers(m)) > 0
    with pytest.raises(ValueError, match="compile_layers"):
        R.enable(m, compile_layers="sometimes")
    with pytest.raises(ValueError, match="no decoder layers"):
        R.enable(torch.nn.Linear(2, 2), compile_layers=True)


def test_flex_is_traced_into_the_layer_graph():
    """Packed flex with the cache on: the BlockMasks are built once per batch before the layers
    and enter the graph as inputs, so there is no graph break and no recompile per batch.
    Forward only: compiled flex on CPU supports inference only."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    models_ = []
    for comp in (False, True):
        # no checkpointing: its input hook makes layer 0's input require grad even under
        # no_grad, which is a second graph for layer 0 (training has one for all layers)
        m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4,
                         gradient_checkpointing=False)
        P.enable(m, packing_backend="flex")
        R.enable(m, compile_layers=comp)
        models_.append(m)
    eager, comp = models_
    P.reset_counters()
    for lengths in LENGTHS:
        meta = P.PackedMetadata.from_lengths(lengths)
        ids = torch.randint(0, 100, (meta.batch_size, meta.seq_len), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs = [m(input_ids=ids, position_ids=meta.position_ids(), **P.packed_kwargs(meta)).logits
                    for m in (eager, comp)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    d = R.describe(comp)
    assert d["flex_traced"] and "compile_error" not in d and d["layer_calls"]["eager"] == 0
    assert not counters["graph_break"] and not counters["recompiles"]
    assert _graphs_per_layer_code(comp) == 1  # one graph for every layer and every batch
    # one BlockMask per batch: built before the compiled model's layers, then a cache hit for
    # the eager model on the same batch (the cache is per device and keyed by the batch)
    assert P.counters()["flex_block_mask"] == len(LENGTHS)


@pytest.mark.parametrize("mode", ["double", "save_on_cpu"])
def test_compiled_layers_under_offloaded_checkpointing(mode):
    """optim.offload wraps each layer call; the compiled layer runs inside, forward and recompute,
    and the loss and LoRA gradients stay those of plain eager checkpointing."""
    import optim.offload as oo

    def run(offload, compile_layers):
        spec = dataclasses.replace(models.get("qwen3-0.6b-tiny"), num_hidden_layers=4)  # 2 offloaded
        m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
        randomize_lora_b(m)
        oo.enable(m, offload=offload, min_bytes=0)
        R.enable(m, compile_layers=compile_layers)
        out = [_step(m, lengths) for lengths in LENGTHS[:2]]
        return out, R.describe(m), oo.get(m)

    ref, _, _ = run("none", False)
    got, d, off = run(mode, True)
    for a, b in zip(ref, got):
        _assert_same(a, b)
    assert "compile_error" not in d and d["layer_calls"]["eager"] == 0
    if mode == "double":
        assert off.stats()["offloaded"] > 0


def test_adapters_train_and_eval_stay_compiled_past_dynamos_default_recompile_limit(monkeypatch):
    """Four adapters, each on and off, in train and in eval: 16 entries per layer, past dynamo's
    default of 8, after which it would run the layers eager without a word in describe()."""
    import functools
    import io

    from peft import LoraConfig

    from optim import regional

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))  # no C++ build here
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4,
                         gradient_checkpointing=False)
        for name in "bcd":
            m.add_adapter(name, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        optim.enable(m, compile_layers=True)
        ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        for mode in ("train", "eval"):
            getattr(m, mode)()
            for adapter in ("default", "b", "c", "d"):
                m.set_adapter(adapter)
                m(input_ids=ids, labels=ids)
                with m.disable_adapter():
                    m(input_ids=ids, labels=ids)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert "recompile_limit" not in said.getvalue() and "cache_size_limit" not in said.getvalue(), said.getvalue()[-500:]
    assert regional.describe(m)["layer_calls"]["eager"] == 0
