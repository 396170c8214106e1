"""optim.moe on CPU, fp32: every backend and split vs merged LoRA match the `loop` reference on
outputs, loss and every LoRA gradient, for the gpt-oss and Qwen3-MoE tiny twins."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _moe_common import (
    BACKENDS,
    MODELS,
    build,
    experts_of,
    rel_err,
    router_of,
    routings,
    run_experts,
    run_model,
)

import optim.moe as moe

MODES = [(b, lora) for b in BACKENDS for lora in ("merged", "split")]
RANK = 4  # fp32: 16-byte rows, so the CPU grouped_mm kernel runs natively


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return build(request.param, "cpu", torch.float32, RANK)


def _lora_params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _close(a, b, tol=2e-5):
    assert rel_err(a, b) < tol, rel_err(a, b)


@pytest.mark.parametrize("batch,seq", [(2, 24), (1, 1)], ids=["batch2", "single_token"])
def test_model_matches_loop(model, batch, seq):
    params = _lora_params(model)
    assert any("experts" in n and "lora_A" in n for n in params)  # expert LoRA is in the check
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))
    moe.enable(model, moe_backend="loop", moe_lora="merged")
    ref_loss, ref_logits, ref_grads = run_model(model, ids, params)
    for backend, lora in MODES[1:]:
        moe.enable(model, moe_backend=backend, moe_lora=lora)
        loss, logits, grads = run_model(model, ids, params)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        _close(logits, ref_logits)
        for n in ref_grads:
            assert rel_err(grads[n], ref_grads[n]) < 1e-4, (backend, lora, n)


def test_stock_transformers_matches_loop(model):
    """The reference is the stock behaviour: transformers' own eager experts + peft."""
    params = _lora_params(model)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    moe.enable(model, moe_backend="loop", moe_lora="merged")
    ref = run_model(model, ids, params)
    model.config._experts_implementation = "eager"
    try:
        got = run_model(model, ids, params)
    finally:
        moe.enable(model)
    _close(got[1], ref[1])
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) < 1e-4, n


def test_ties_in_router(model):
    """A zero router makes every logit equal: top-k ties, all tokens on the same k experts and
    the other experts empty. The router gradient is checked too (moe_train_router)."""
    router = router_of(model, 0)
    saved = {n: p.detach().clone() for n, p in router.named_parameters()}
    with torch.no_grad():
        for p in router.parameters():
            p.zero_()
    try:
        ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
        moe.enable(model, moe_backend="loop", moe_lora="merged", moe_train_router=True)
        params = _lora_params(model)
        assert any(p is router.weight for p in params.values())
        ref = run_model(model, ids, params)
        for backend, lora in MODES[1:]:
            moe.enable(model, moe_backend=backend, moe_lora=lora, moe_train_router=True)
            got = run_model(model, ids, params)
            _close(got[1], ref[1])
            for n in ref[2]:
                assert rel_err(got[2][n], ref[2][n]) < 1e-4, (backend, lora, n)
    finally:
        moe.enable(model)
        with torch.no_grad():
            for n, p in router.named_parameters():
                p.copy_(saved[n])
    assert not router.weight.requires_grad  # frozen again by default


def test_routing_edge_cases(model):
    """One experts layer on explicit routings: empty experts, every pair on one expert (even
    twice per token), every token sharing one expert, a single token."""
    experts = experts_of(model, 0)
    base = experts.get_base_layer()
    E, H = base.num_experts, model.config.hidden_size
    k = model.config.num_experts_per_tok
    params = {n: p for n, p in experts.named_parameters() if p.requires_grad}
    assert len(params) == 4  # lora_A/lora_B of gate_up_proj and down_proj
    for name, idx in routings(10, E, k, "cpu"):
        T = idx.shape[0]
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        wts = torch.rand(T, k, generator=torch.Generator().manual_seed(T + 1))
        moe.enable(model, moe_backend="loop", moe_lora="merged")
        ref_out, ref_grads = run_experts(experts, hidden, idx, wts, params)
        assert ref_out.abs().sum() > 0
        for backend, lora in MODES[1:]:
            moe.enable(model, moe_backend=backend, moe_lora=lora)
            out, grads = run_experts(experts, hidden, idx, wts, params)
            _close(out, ref_out)
            for n in ref_grads:
                assert rel_err(grads[n], ref_grads[n]) < 1e-4, (name, backend, lora, n)
    moe.enable(model)


def test_split_never_materializes_delta(model, monkeypatch):
    """In split mode peft's B·A (get_delta_weight / get_delta_factors) is never computed."""
    from peft.tuners.lora.layer import ParamWrapper

    calls = []
    for fn in ("get_delta_weight", "get_delta_factors"):
        orig = getattr(ParamWrapper, fn)
        monkeypatch.setattr(ParamWrapper, fn, lambda self, *a, _o=orig, _n=fn, **kw: calls.append(_n) or _o(self, *a, **kw))
    ids = torch.randint(0, 512, (1, 8))
    moe.enable(model, moe_backend="sorted", moe_lora="split")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert calls == []
    moe.enable(model, moe_backend="sorted", moe_lora="merged")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert calls  # merged is peft's own path
    moe.enable(model)


def test_host_syncs_per_forward(model):
    """loop: one sync per expert per layer; sorted: one per layer; grouped_mm: none."""
    ids = torch.randint(0, 512, (1, 16))
    L = model.config.num_hidden_layers
    E = experts_of(model).get_base_layer().num_experts
    expected = {"loop": L * E, "sorted": L, "grouped_mm": 0}
    for backend, n in expected.items():
        moe.enable(model, moe_backend=backend)
        with torch.no_grad(), moe.count_host_syncs() as syncs:
            model(input_ids=ids, use_cache=False)
        assert syncs.counted == n, (backend, syncs)
    moe.enable(model)


def test_split_under_gradient_checkpointing():
    """The harness trains with checkpointing: the recompute must see the split-LoRA factors too."""
    name = "gpt-oss-20b-tiny"
    plain = build(name, "cpu", torch.float32, RANK)
    ckpt = build(name, "cpu", torch.float32, RANK, gradient_checkpointing=True)
    ids = torch.randint(0, 512, (1, 16))
    moe.enable(plain, moe_backend="loop", moe_lora="merged")
    moe.enable(ckpt, moe_backend="grouped_mm", moe_lora="split")
    ref = run_model(plain, ids, _lora_params(plain))
    got = run_model(ckpt, ids, _lora_params(ckpt))
    _close(got[1], ref[1])
    for n in ref[2]:
        assert rel_err(got[2][n], ref[2][n]) < 1e-4, n


def test_peft_save_load_roundtrip(tmp_path):
    """Split mode keeps peft's parameters, so save_pretrained / from_pretrained still work."""
    from peft import PeftModel, get_peft_model_state_dict

    name = "qwen3-30b-a3b-tiny"
    a = build(name, "cpu", torch.float32, RANK, seed=0)
    keys_before = set(get_peft_model_state_dict(a))
    moe.enable(a, moe_backend="sorted", moe_lora="split")
    assert set(get_peft_model_state_dict(a)) == keys_before
    a.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        want = a(input_ids=ids, use_cache=False).logits
    b = build(name, "cpu", torch.float32, None, seed=0)  # same base weights, no LoRA yet
    b = PeftModel.from_pretrained(b, tmp_path)
    moe.enable(b, moe_backend="grouped_mm", moe_lora="split")
    with torch.no_grad():
        got = b(input_ids=ids, use_cache=False).logits
    _close(got, want)


def test_switches_and_env(monkeypatch):
    sw = moe.SWITCHES
    assert sw["moe_backend"].choices == ("auto", "loop", "sorted", "grouped_mm")
    assert sw["moe_backend"].default == "auto" and sw["moe_lora"].default == "split"
    assert sw["moe_train_router"].default is False
    monkeypatch.setenv("OPTIM_MOE_BACKEND", "loop")
    assert moe.resolve()["moe_backend"] == "loop"
    assert moe.resolve(moe_backend="sorted")["moe_backend"] == "sorted"  # kwarg beats env
    with pytest.raises(ValueError):
        moe.resolve(moe_backend="nope")
    with pytest.raises(TypeError):
        moe.resolve(backend="loop")
    assert moe.auto_backend("cpu") == "sorted"


def test_enable_on_dense_model_is_noop():
    from harness.workload import models

    m = models.build(models.get("qwen3-0.6b-tiny"), device="cpu", dtype=torch.float32, lora_rank=4,
                     gradient_checkpointing=False)
    assert moe.enable(m) is m and not hasattr(m, "_optim_moe")


def test_import_does_not_pull_harness():
    code = "import sys, optim.moe; assert not any(m == 'harness' or m.startswith('harness.') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


# ---------------------------------------------------------------------------------------------
# moe_compile: the grouped path as one torch.compile'd graph (bf16: grouped_mm's compiled meta
# takes bf16 only). Checked against the fp32 loop, with the bf16 loop's own error as the bar.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [RANK, 8])
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_grouped_matches_loop(name, rank):
    """Rank 4 in bf16 is padded to 8 for the compiled kernel (the eager grouped path falls back per
    expert there); rank 8 gives both the LoRA A factor as a transposed view of peft's weight."""
    from optim import _moe_compiled as compiled

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    runs = {}
    for label, dtype, settings, ckpt in (
        ("ref", torch.float32, dict(moe_backend="loop", moe_lora="merged"), False),
        ("loop_bf16", torch.bfloat16, dict(moe_backend="loop", moe_lora="merged"), False),
        ("compiled", torch.bfloat16, dict(moe_backend="grouped_mm", moe_lora="split", moe_compile=True,
                                          moe_saved="all"), True),
        # what backward keeps differs (moe_saved); the routing weights scale the down input, not its output
        ("lean", torch.bfloat16, dict(moe_backend="grouped_mm", moe_lora="split", moe_compile=True,
                                      moe_saved="lean"), False),
        # and inside a checkpointed layer, recomputed whole in backward
        ("lean_ckpt", torch.bfloat16, dict(moe_backend="grouped_mm", moe_lora="split", moe_compile=True,
                                           moe_saved="lean"), True),
        ("eager", torch.bfloat16, dict(moe_backend="grouped_mm", moe_lora="split", moe_compile=False), False),
    ):
        m = build(name, "cpu", dtype, rank, gradient_checkpointing=ckpt)
        moe.enable(m, **settings)
        runs[label] = run_model(m, ids, _lora_params(m))
        if label in ("compiled", "lean", "lean_ckpt"):
            assert ("cpu", torch.bfloat16) not in compiled.COMPILE_FAILED
            assert "moe_compile_errors" not in moe.describe(m)
    (rl, rg, rgr), (bl, bg, bgr) = runs["ref"], runs["loop_bf16"]
    bar = lambda a, b: 1.5 * rel_err(a.float(), b.float()) + 2e-2  # noqa: E731
    for label in ("compiled", "lean", "lean_ckpt", "eager"):
        cl, cg, cgr = runs[label]
        assert abs(cl.float() - rl) <= 1.5 * abs(bl.float() - rl) + 2e-2, label
        assert rel_err(cg.float(), rg) <= bar(bg, rg), label
        for n in rgr:
            assert rel_err(cgr[n].float(), rgr[n]) <= bar(bgr[n], rgr[n]), (label, n)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32], ids=["bf16_weights", "fp32_weights"])
@pytest.mark.parametrize("name", list(MODELS))
def test_lean_experts_match_loop_with_biases(name, wdtype):
    """moe_saved="lean" moves the routing weights from the down projection's output to its input,
    and scales the down bias by them: checked on one experts layer with explicit routing (no
    router ties to flip), non-zero expert biases (gpt-oss starts them at zero) and bf16 or fp32
    routing weights, against the loop reference on the output and every gradient."""
    m = build(name, "cpu", torch.bfloat16, 8)
    experts = experts_of(m, 0)
    base = experts.get_base_layer()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("_bias"):
                p.copy_(torch.randn(p.shape, generator=g).mul_(0.5).to(p))
    E, H, k = base.num_experts, m.config.hidden_size, m.config.num_experts_per_tok
    params = {n: p for n, p in experts.named_parameters() if p.requires_grad}
    for label, idx in routings(20, E, k, "cpu"):
        T = idx.shape[0]
        hidden = torch.randn(T, H, generator=g).to(torch.bfloat16)
        wts = torch.rand(T, k, generator=g).to(wdtype)
        moe.enable(m, moe_backend="loop", moe_lora="merged")
        ref_out, ref_grads = run_experts(experts, hidden, idx, wts, params)
        for saved in ("all", "lean"):
            moe.enable(m, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved=saved)
            out, grads = run_experts(experts, hidden, idx, wts, params)
            assert rel_err(out.float(), ref_out.float()) < 2e-2, (label, saved)
            for n in ref_grads:
                assert rel_err(grads[n].float(), ref_grads[n].float()) < 3e-2, (label, saved, n)
    moe.enable(m)


@pytest.mark.parametrize("saved", ["lean", "all"])
def test_compile_failure_falls_back_to_eager(monkeypatch, caplog, saved):
    """fp32 on CPU: the compiled grouped_mm rejects fp32, so the layer logs once per graph tried
    (lean's where set, then the partitioner's, the default) and runs eager, with the eager grouped path's exact
    numbers."""
    from optim import _moe_compiled as compiled

    name = "qwen3-30b-a3b-tiny"
    ids = torch.randint(0, 512, (1, 16))
    eager = build(name, "cpu", torch.float32, RANK)
    moe.enable(eager, moe_backend="grouped_mm", moe_compile=False)
    ref = run_model(eager, ids, _lora_params(eager))
    comp = build(name, "cpu", torch.float32, RANK)
    moe.enable(comp, moe_backend="grouped_mm", moe_compile=True, **({} if saved == "all" else {"moe_saved": saved}))
    monkeypatch.setattr(compiled, "COMPILE_FAILED", {})  # this test's failures alone, none left behind
    with caplog.at_level("WARNING", logger="optim._moe_compiled"):
        got = run_model(comp, ids, _lora_params(comp))
    assert ("cpu", torch.float32) in compiled.COMPILE_FAILED
    assert (("cpu", torch.float32, "lean") in compiled.COMPILE_FAILED) == (saved == "lean")
    assert "cpu/torch.float32" in moe.describe(comp)["moe_compile_errors"]
    assert sum("torch.compile of the grouped experts failed" in r.message for r in caplog.records) == 1
    assert sum("torch.compile of the grouped experts (moe_saved=lean) failed" in r.message
               for r in caplog.records) == (saved == "lean")
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=0, atol=0)


def test_a_lean_compile_failure_falls_back_to_the_partitioners_graph(monkeypatch, caplog):
    """A failure that only moe_saved="lean"'s graph hits is recorded as lean's: that
    layer and every later one run the compiled graph of moe_saved="all", with that graph's exact
    numbers, and a model set to "all" runs it too."""
    from optim import _moe_compiled as compiled

    def broken(*args):
        raise NotImplementedError("lean graph broken on purpose")

    key = ("cpu", torch.bfloat16, "lean")
    ids = torch.randint(0, 512, (1, 12))
    ref = build("qwen3-30b-a3b-tiny", "cpu", torch.bfloat16, 8)
    moe.enable(ref, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved="all")
    want = run_model(ref, ids, _lora_params(ref))
    monkeypatch.setattr(compiled, "_lean_body", broken)
    m = build("qwen3-30b-a3b-tiny", "cpu", torch.bfloat16, 8)
    calls = []
    real = compiled.compiled_grouped(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(compiled, "_compiled", lambda *a: calls.append(a[11]) or real(*a))
    try:
        moe.enable(m, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved="lean")
        with caplog.at_level("WARNING", logger="optim._moe_compiled"):
            got = run_model(m, ids, _lora_params(m))
        assert key in compiled.COMPILE_FAILED and ("cpu", torch.bfloat16) not in compiled.COMPILE_FAILED
        assert "cpu/torch.bfloat16/lean" in moe.describe(m)["moe_compile_errors"]
        assert sum("(moe_saved=lean) failed" in r.message and "the partitioner's graph (moe_saved=all) runs instead"
                   in r.message for r in caplog.records) == 1
        # lean's graph tried once, then the partitioner's graph for that layer and every later one
        layers = sum(1 for x in m.modules() if moe._is_experts(x))
        assert calls == [True] + [False] * layers, calls
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for n in want[2]:
            torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0)
        calls.clear()
        moe.enable(m, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved="all")
        run_model(m, ids, _lora_params(m))
        assert calls and not any(calls) and ("cpu", torch.bfloat16) not in compiled.COMPILE_FAILED
    finally:
        compiled.COMPILE_FAILED.pop(key, None)
        moe.enable(m)


@pytest.mark.parametrize("tokens,lean", [(5, False), (8, True), (1, False), (4, True)])
def test_lean_graph_takes_only_row_counts_of_16_bytes(monkeypatch, tokens, lean):
    """moe_saved="lean" runs its graph only where the routed rows (tokens × top-k)
    make a 16-byte multiple in the dtype: its backward may lay the recomputed rows out transposed,
    with a row stride grouped_mm refuses otherwise (seen on CUDA at 20 rows of bf16). Other
    batches run the partitioner's graph, with nothing recorded as failed, and the loop's numbers."""
    from optim import _moe_compiled as compiled

    name = "gpt-oss-20b-tiny"  # top-2 in bf16: 4 bytes a token, a 16-byte multiple at 4, 8, ... tokens
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(2))
    ref = build(name, "cpu", torch.float32, 8)
    moe.enable(ref, moe_backend="loop", moe_lora="merged")
    want = run_model(ref, ids, _lora_params(ref))
    m = build(name, "cpu", torch.bfloat16, 8)
    moe.enable(m, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved="lean")
    calls = []
    real = compiled.compiled_grouped(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(compiled, "_compiled", lambda *a: calls.append(a[11]) or real(*a))
    got = run_model(m, ids, _lora_params(m))
    assert calls and all(c is lean for c in calls), calls
    assert not any(k[:2] == ("cpu", torch.bfloat16) for k in compiled.COMPILE_FAILED), compiled.COMPILE_FAILED
    assert abs(got[0].float() - want[0]) < 3e-2 * abs(want[0])
    for n in want[2]:
        assert rel_err(got[2][n].float(), want[2][n]) < 5e-2, n


def test_compiled_path_survives_many_shapes():
    """More shapes than dynamo's default recompile limit (8) through the one compiled function:
    still compiled, no fallback (the GPU suite hit the limit before it was raised)."""
    from optim import _moe_compiled as compiled

    m = build("qwen3-30b-a3b-tiny", "cpu", torch.bfloat16, 8)
    moe.enable(m, moe_backend="grouped_mm", moe_lora="split", moe_compile=True)
    torch._dynamo.config.automatic_dynamic_shapes = False  # force one entry per shape
    try:
        for t in range(1, 11):
            m(input_ids=torch.randint(0, 512, (1, t)), use_cache=False).logits.sum().backward()
    finally:
        torch._dynamo.config.automatic_dynamic_shapes = True
    assert ("cpu", torch.bfloat16) not in compiled.COMPILE_FAILED, compiled.COMPILE_FAILED


def test_experts_with_a_norm_after_each_expert_keep_transformers_own(caplog):
    """Experts of the fused layout that normalize each expert's output (has_post_expert_norm) or
    are sharded over ranks are left to transformers, which does both: the backends here do neither."""
    M = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    cfg = M.MuseSparkTextConfig(hidden_size=32, moe_hidden_size=32, moe_intermediate_size=16, num_local_experts=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    experts = M.MuseSparkExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    assert experts.has_post_expert_norm and moe._has_layout(experts) and not moe._is_experts(experts)
    h, w = torch.randn(10, 32), torch.rand(10, 2)
    idx = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(i))[:2] for i in range(10)])
    stock = experts(h, idx, w)
    holder = torch.nn.ModuleDict({"experts": experts})
    with caplog.at_level("WARNING", logger="optim.moe"):
        moe.enable(holder, moe_backend="sorted")
    assert "a norm after each expert" in caplog.text
    assert not str(getattr(cfg, "_experts_implementation", "") or "").startswith(moe.IMPL_PREFIX)
    torch.testing.assert_close(experts(h, idx, w), stock, rtol=0, atol=0)
    experts._is_expert_parallel, experts.has_post_expert_norm = True, False
    assert moe._refusal(experts) == "experts sharded over ranks (expert parallel)"


@pytest.mark.parametrize("name", list(MODELS))
def test_router_the_user_made_trainable_through_peft_stays_trainable(name):
    """A router in peft's ``modules_to_save`` is the user's choice to train it: the default
    (router frozen) freezes the router's own weights, not the copy peft trains and saves."""
    from peft import LoraConfig, get_peft_model

    base = build(name, "cpu", torch.float32, None)
    router_name = "router" if hasattr(base.model.layers[0].mlp, "router") else "gate"
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"],
                        modules_to_save=[router_name])
    model = get_peft_model(base, config)
    wrapper = getattr(model.get_base_model().model.layers[0].mlp, router_name)
    copy = [p for n, p in wrapper.named_parameters() if "modules_to_save" in n]
    original = [p for n, p in wrapper.named_parameters() if "modules_to_save" not in n]
    assert copy and original and all(p.requires_grad for p in copy)
    moe.enable(model, moe_backend="loop")
    assert all(p.requires_grad for p in copy), "the router copy peft trains was frozen"
    assert not any(p.requires_grad for p in original)
    ids = torch.randint(0, 512, (1, 8))
    model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in copy)
    # the original is out of the forward while peft trains its copy: training it would add a
    # parameter that never gets a gradient (DDP without find_unused_parameters refuses it)
    moe.enable(model, moe_backend="loop", moe_train_router=True)
    assert all(p.requires_grad for p in copy) and not any(p.requires_grad for p in original)
    # disable() leaves what peft owns alone: with two adapters, the active one's copy trains after it
    config_b = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"],
                          modules_to_save=[router_name])
    model.add_adapter("b", config_b)
    model.set_adapter("b")
    copy_b = [p for n, p in wrapper.named_parameters() if "modules_to_save.b." in n]
    assert copy_b and all(p.requires_grad for p in copy_b)
    moe.disable(model)
    assert all(p.requires_grad for p in copy_b) and not any(p.requires_grad for p in original)


def test_a_router_with_a_lora_adapter_keeps_its_factors_trainable_and_freezes_its_weight():
    """LoRA on the router itself (peft ``target_parameters``): its factors are the user's to train;
    the router's own weight follows ``moe_train_router``."""
    from peft import LoraConfig, get_peft_model

    base = build("qwen3-30b-a3b-tiny", "cpu", torch.float32, None)
    model = get_peft_model(base, LoraConfig(r=RANK, target_modules=["q_proj"], target_parameters=["mlp.gate.weight"]))
    router = model.get_base_model().model.layers[0].mlp.gate
    factors = [p for n, p in router.named_parameters() if "lora_" in n]
    weights = [p for n, p in router.named_parameters() if "lora_" not in n]
    assert factors and weights and all(p.requires_grad for p in factors)
    moe.enable(model, moe_backend="loop")
    assert all(p.requires_grad for p in factors) and not any(p.requires_grad for p in weights)
    moe.enable(model, moe_backend="loop", moe_train_router=True)
    assert all(p.requires_grad for p in factors + weights)
    moe.disable(model)
    assert all(p.requires_grad for p in factors) and not any(p.requires_grad for p in weights)


def test_a_sync_is_torchs_sync_warning_not_its_notice_on_entering_the_mode():
    """``count_host_syncs`` (and the packing bench, and the GPU tests) count torch's sync debug
    warnings; torch's one notice on entering the mode also says "synchronizing" and is none."""
    import warnings

    from optim._syncs import is_sync_warning

    def caught(text):
        return warnings.WarningMessage(UserWarning(text), UserWarning, "x.py", 1)

    assert is_sync_warning(caught("called a synchronizing CUDA operation"))
    assert not is_sync_warning(caught("Synchronization debug mode is a prototype feature and does not yet detect all "
                                      "synchronizing operations (Triggered internally at Module.cpp:1003.)"))


def test_lora_factors_are_new_tensors_not_views_of_peft_weights(model):
    """The public factors of an fp32 adapter need no cast, yet are copies: editing one in place
    leaves peft's weight alone."""
    wrapper = experts_of(model)
    while not hasattr(wrapper, "lora_A") or not wrapper.lora_A:  # the outer wrapper may be the other projection's
        wrapper = wrapper.base_layer
    adapter = next(iter(wrapper.lora_A))
    weight = wrapper.lora_A[adapter].weight
    a_t, b_t, _ = moe.lora_factors(wrapper, adapter)
    assert a_t.is_contiguous() and b_t.is_contiguous()
    before = weight.detach().clone()
    with torch.no_grad():
        a_t.zero_()
        b_t.zero_()
    assert torch.equal(weight, before)
