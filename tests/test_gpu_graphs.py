"""optim.graphs on CUDA: a training step captured as CUDA graphs and replayed trains the model
as the same eager steps do (bf16 tolerance), for stock dense models and for optim.moe's
grouped_mm with split LoRA; and a sweep point with cuda_graph = true is a timed row. < 2 min."""

from __future__ import annotations

import pytest
import torch
from _sweep import small_gpu_experiment

from harness import results as res
from harness.run import sweep
from harness.run.experiment import DataSpec
from harness.workload import models
from harness.workload.data import make_batch
from harness.workload.loss import causal_lm_loss
from optim import graphs

pytestmark = pytest.mark.gpu

T = 512
CASES = {
    "llama-sdpa": ("llama-3.2-1b-tiny", "sdpa", {}),
    "qwen3-flex": ("qwen3-0.6b-tiny", "flex_attention", {}),
    "gpt-oss-grouped_mm-split": ("gpt-oss-20b-tiny", "flex_attention", {"moe_backend": "grouped_mm", "moe_lora": "split"}),
    "qwen3-moe-grouped_mm-split": ("qwen3-30b-a3b-tiny", "sdpa", {"moe_backend": "grouped_mm", "moe_lora": "split"}),
    # one document per row: eager transformers finds no packing, a capture builds the packed mask
    "qwen3-moe-flex-one-doc": ("qwen3-30b-a3b-tiny", "flex_attention", {"moe_backend": "grouped_mm", "moe_lora": "split"}),
    # optim.packing with no host metadata: the capture reads the boundaries from the static
    # position_ids on the device, so batches of other document lengths replay the same graph
    "packed-flex-varying": ("qwen3-0.6b-tiny", "sdpa", {"packing_backend": "flex"}),
    "packed-sdpa-varying": ("llama-3.2-1b-tiny", "sdpa", {"packing_backend": "sdpa"}),
    "packed-flex-compiled-varying": ("gpt-oss-20b-tiny", "sdpa", {"packing_backend": "auto", "compile_layers": True}),
}
VARYING = {"packed-flex-varying", "packed-sdpa-varying", "packed-flex-compiled-varying"}
ONE_DOC = {"qwen3-moe-flex-one-doc"}


def _build(name, attn, moe_settings, one_doc=False):
    spec = models.get(name)
    model = models.build(spec, device="cuda", dtype=torch.bfloat16, attn_implementation=attn, lora_rank=8,
                         gradient_checkpointing=True, seed=0, checkpoint_preserve_rng=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft's zero lora_B would hide a LoRA path that is wrong
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).mul_(0.05).to(p))
    if moe_settings:
        import optim
        from harness.variant_keys import optim_settings

        optim.enable(model, only=tuple(optim_settings(moe_settings)), **moe_settings)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, fused=True, capturable=True)
    data = DataSpec(distribution="fixed", median_doc_len=T, seed=3) if one_doc else DataSpec(seed=3)
    batches = [make_batch(data, T, 2, spec.vocab_size, step=i).to("cuda") for i in range(4)]
    return model, opt, batches


def _loss(model, b):
    return causal_lm_loss(model, b.input_ids, b.labels, chunked=False, position_ids=b.position_ids)


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_graph_trains_like_the_eager_steps(case):
    name, attn, moe_settings = CASES[case]
    # eager reference: the capture's two side-stream warm-up steps on batch 0, then batches 1-3
    ref, ref_opt, batches = _build(name, attn, moe_settings, case in ONE_DOC)
    ref_losses = []
    for b in [batches[0], batches[0], *batches[1:]]:
        loss = _loss(ref, b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.detach().float())

    model, opt, batches = _build(name, attn, moe_settings, case in ONE_DOC)
    graphs.check_capturable(model, opt)
    static = {k: getattr(batches[0], k).clone() for k in ("input_ids", "labels", "position_ids")}
    step = graphs.GraphedStep(lambda: causal_lm_loss(model, static["input_ids"], static["labels"], chunked=False,
                                                     position_ids=static["position_ids"]), opt)
    from optim import packing

    packing.reset_counters()
    step.capture()
    if case in VARYING:
        assert len({tuple(map(tuple, b.lengths)) for b in batches}) == len(batches)  # every batch its own
        assert packing.counters().get("from_position_ids_on_device", 0) >= 1, packing.counters()
    losses = []
    for b in batches[1:]:
        for k, buf in static.items():
            buf.copy_(getattr(b, k))
        losses.append(step.forward().detach().float().clone())
        step.backward()
        step.optimizer_step()
    torch.cuda.synchronize()
    assert torch.allclose(torch.stack(losses), torch.stack(ref_losses[2:]), rtol=2e-2)
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for n, p in trained:
        want = ref_params[n].float()
        err = (p.float() - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 3e-2, f"{case}: {n} differs from the eager steps by {err:.3g}"


def test_a_graphed_point_is_a_timed_row_beside_its_eager_twin(tmp_path):
    exp = small_gpu_experiment("gpu-graph", {"sdpa": {"attn_implementation": "sdpa"},
                                             "sdpa-graph": {"attn_implementation": "sdpa", "cuda_graph": True}})
    summary = sweep.run(exp, tmp_path, progress=False)
    assert summary.statuses == {"ok": 2}
    rows = {r["variant"]: r for r in res.read_rows(summary.results_path)}
    graphed, eager = rows["sdpa-graph"], rows["sdpa"]
    assert graphed["cuda_graph"] is True and graphed["graph_capture_ms"] > 0
    assert eager["cuda_graph"] is False and eager["graph_capture_ms"] is None
    # a replay allocates nothing: the graphed peak is the capture's, the same tensors as an eager step
    assert graphed["peak_scope"] == "capture and replays"
    assert graphed["peak_allocated_gib"] == pytest.approx(eager["peak_allocated_gib"], rel=0.15)
    phases = sum(graphed[k]["p50"] for k in ("forward_ms", "backward_ms", "optimizer_ms"))
    assert graphed["step_ms"]["p50"] == pytest.approx(phases, rel=0.15)
    assert all(torch.isfinite(torch.tensor(graphed["loss"])))
    # the same model, data and seed: the first measured losses agree
    assert graphed["loss"][0] == pytest.approx(eager["loss"][0], rel=0.05)


def test_the_one_call_replayed_as_graphs_keeps_its_recompute_decision(tmp_path):
    """optim.enable(model) with every default (stack 'user'), the step captured: every module is on,
    as in the eager user row, and the capture skips the recomputes the eager steps skip."""
    exp = small_gpu_experiment("gpu-user-graph", {"user": {"role": "user"},
                                                  "user-graph": {"role": "ours", "stack": "user", "cuda_graph": True}})
    summary = sweep.run(exp, tmp_path, progress=False)
    assert summary.statuses == {"ok": 2}
    rows = {r["variant"]: r for r in res.read_rows(summary.results_path)}
    graphed, eager = rows["user-graph"], rows["user"]
    assert graphed["cuda_graph"] is True and eager["cuda_graph"] is False
    assert set(graphed["optim"]) == set(eager["optim"]), (set(graphed["optim"]), set(eager["optim"]))
    rs_g, rs_e = graphed["optim"]["optim.recompute"], eager["optim"]["optim.recompute"]
    assert rs_e["layers_skipped"]["last"] > 0, rs_e  # a 0.6B model at 1024 tokens fits: the test can fail
    # layers_skipped is the eager forwards' decision; the capture's own shows in the recompute count: the
    # step's Python runs once more at the capture, so a capture that kept every recompute counts more
    assert rs_g["recomputes"] == rs_e["recomputes"], (rs_g, rs_e)
    assert graphed["loss"][0] == pytest.approx(eager["loss"][0], rel=0.05)
