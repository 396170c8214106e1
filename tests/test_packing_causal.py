"""optim.packing's ``auto`` on rows of one document each (CPU, fp32): plain causal SDPA, in eager
and in compiled layers, with each document alone's loss and gradients; any batch with a boundary
inside a row, and models with sinks or sliding windows, keep the packed kernels."""

from __future__ import annotations

import pytest
import torch
from _lora import randomize_lora_b
from _packed_step import assert_same_step as _same, packed_step as _step

import optim.packing as P
import optim.regional as R
from optim.packing.backends import one_document_per_row
from harness.workload import models

ONE_PER_ROW = [[96], [96]]
PACKED = [[40, 56], [96]]  # one row whole, the other two documents: not a batch of whole rows


def _build(name="llama-3.2-1b-tiny", compile_layers=False, backend="auto"):
    model = models.build(models.get(name), device="cpu", dtype=torch.float32, lora_rank=4)
    randomize_lora_b(model)
    P.enable(model, packing_backend=backend)
    if compile_layers:
        R.enable(model, compile_layers=True)
    return model


def _entry(lengths):
    return P.build_entry(("t", str(lengths)), P.PackedMetadata.from_lengths(lengths), torch.device("cpu"))


def test_a_batch_is_whole_rows_only_when_no_row_holds_a_boundary():
    assert one_document_per_row(_entry([[96], [96]])) and one_document_per_row(_entry([[7]]))
    assert not one_document_per_row(_entry([[40, 56], [96]]))  # max_seqlen is the row's, one row is not whole
    assert not one_document_per_row(_entry([[40, 56]]))
    # offsets from a collator (cu_seq_lens) may hold a zero-length document: still a boundary
    from optim.packing.metadata import entry_from_cu_seqlens

    cu = torch.tensor([0, 96, 96], dtype=torch.int32)
    assert not one_document_per_row(entry_from_cu_seqlens(("t", "cu"), cu, 96, 1, 96, torch.device("cpu")))
    # built on the device from position_ids (a CUDA-graph capture): no host lengths, so not known
    from optim.packing.metadata import entry_from_position_ids

    assert not one_document_per_row(entry_from_position_ids(("t", "pos"), torch.arange(96)[None], 1, 96,
                                                            torch.device("cpu")))


def test_auto_runs_causal_sdpa_on_whole_rows_with_the_masked_kernels_loss_and_gradients():
    """The reference is the masked SDPA the packed path runs otherwise: each document alone."""
    model, masked = _build(), _build(backend="sdpa")
    masked.load_state_dict(model.state_dict())
    layers = model.config.num_hidden_layers
    P.reset_counters()
    got = _step(model, ONE_PER_ROW)
    # every layer, forward and checkpoint recompute
    assert P.kernels() == {"sdpa-causal": 2 * layers}, P.kernels()
    P.reset_counters()
    _same(got, _step(masked, ONE_PER_ROW))
    assert P.kernels() == {"sdpa-mask": 2 * layers}
    # the next batch has a boundary inside a row: the packed kernel again, from the first layer on
    P.reset_counters()
    _same(_step(model, PACKED, seed=1), _step(masked, PACKED, seed=1))
    assert "sdpa-causal" not in P.kernels(), P.kernels()


def test_models_with_sinks_keep_the_packed_kernel():
    """gpt-oss's attention sinks are not in causal SDPA: its whole rows run the packed kernel."""
    model = _build("gpt-oss-20b-tiny")
    P.reset_counters()
    with torch.no_grad():
        meta = P.PackedMetadata.from_lengths(ONE_PER_ROW)
        model(input_ids=torch.zeros(2, 96, dtype=torch.long), position_ids=meta.position_ids(), use_cache=False,
              **P.packed_kwargs(meta))
    assert "sdpa-causal" not in P.kernels() and P.kernels(), P.kernels()


def test_causal_sdpa_only_where_flash_serves_it_and_never_around_a_capture():
    """fp32 on CUDA with grouped KV heads would take SDPA's math kernel (T x T scores); the CUDA-graph
    warm-up must take the kernel its capture takes, which has no host lengths."""
    from optim.graphs import capture_paths
    from optim.packing.backends import causal_applies

    cuda = torch.device("cuda")
    assert causal_applies(cuda, torch.bfloat16, 128) and causal_applies(cuda, torch.float16, 256)
    assert not causal_applies(cuda, torch.float32, 128) and not causal_applies(cuda, torch.bfloat16, 512)
    assert causal_applies(torch.device("cpu"), torch.float32, 128)
    with capture_paths():
        assert not causal_applies(cuda, torch.bfloat16, 128)
        model = _build()
        P.reset_counters()
        _step(model, ONE_PER_ROW)
        assert "sdpa-causal" not in P.kernels(), P.kernels()
    assert causal_applies(cuda, torch.bfloat16, 128)


def test_a_named_backend_is_kept_on_whole_rows():
    model = _build(backend="sdpa")
    P.reset_counters()
    _step(model, ONE_PER_ROW)
    assert set(P.kernels()) == {"sdpa-mask"}


def test_compiled_layers_trace_causal_sdpa_for_whole_rows_and_match_eager():
    """Compiled layers (optim.regional): the decoder stack's pre-hook marks a batch of whole rows,
    and the layers run causal SDPA inside their graph, forward and recompute, with no graph break
    for it; a packed batch between two of them runs the packed kernel, and each matches eager."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    eager, comp = _build(), _build(compile_layers=True)
    comp.load_state_dict(eager.state_dict())
    P.reset_counters()
    breaks = []
    for i, lengths in enumerate([ONE_PER_ROW, PACKED, ONE_PER_ROW]):
        counters["graph_break"].clear()  # dynamo records a break when it first traces the graph
        _same(_step(comp, lengths, seed=i), _step(eager, lengths, seed=i))
        breaks.append(any("_packed_attention_eager" in str(k) for k in counters["graph_break"]))
    # whole rows: the attention is in the graph; the packed batch (masked SDPA on the CPU) breaks
    # out to the eager kernel, which is what the check would see if whole rows did too
    assert breaks == [False, True, False], breaks
    c = P.counters()
    assert c["causal_batches"] == 2, c
    d = R.describe(comp)
    assert "compile_error" not in d and d["layer_calls"]["eager"] == 0, d
    layers = comp.config.num_hidden_layers
    # the eager model ran causal SDPA on its two whole-row batches (forward + recompute per layer);
    # the compiled one ran it in its graph, where nothing is counted per call
    assert P.kernels()["sdpa-causal"] == 2 * 2 * layers, P.kernels()


def test_a_backend_named_after_compiling_is_kept_by_the_compiled_layers():
    comp = _build(compile_layers=True)
    P.enable(comp, packing_backend="sdpa")
    P.reset_counters()
    _step(comp, ONE_PER_ROW)
    assert P.kernels() == {"sdpa-mask": 2 * comp.config.num_hidden_layers}, P.kernels()


def test_record_names_the_traced_causal_kernel():
    from harness.run.record import attention_kernels

    comp = _build(compile_layers=True)
    P.reset_counters()
    _step(comp, ONE_PER_ROW)
    ran = attention_kernels(comp, {"optim.packing": {}, "optim.regional": {}})["attention_kernels"]
    assert "sdpa-causal-traced" in ran and "flex-fused-traced" not in ran, ran


@pytest.fixture(autouse=True)
def _release():
    yield
    P.release()
