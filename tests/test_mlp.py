"""optim.mlp: SwiGLU MLPs in token chunks keep only their input, and compute the same gradients."""

import pytest
import torch
from _lora import randomize_lora_b
from torch import nn

import optim
from harness.workload import models
from optim import mlp as M


def _batch(spec, seed=0, tokens=600):
    from harness.run.experiment import DataSpec
    from harness.workload.data import make_batch

    return make_batch(DataSpec(median_doc_len=100, seed=seed), tokens, 2, spec.vocab_size)


def _build(spec, dtype, **switches):
    model = randomize_lora_b(models.build(spec, device="cpu", dtype=dtype, lora_rank=4), seed=3)
    return optim.enable(model, only=("lora", "mlp"), **switches)


def _step(model, b):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,dtype,lora", [("qwen3-0.6b-tiny", torch.float32, "fused"),
                                             ("qwen3-0.6b-tiny", torch.bfloat16, "fused"),
                                             ("llama-3.2-1b-tiny", torch.bfloat16, "peft")])
def test_chunked_mlp_gives_the_unchunked_loss_and_gradients_at_every_step(name, dtype, lora):
    """2 x 600 tokens in chunks of 256: four full chunks and a tail, through the layers' checkpoint
    and its recompute, at each of three steps of a loop, on the weights the unchunked model's AdamW
    reached; with peft's own LoRA layers too (the chunks then compute the adapters as optim.lora
    does, in the model's dtype, so bf16's tolerance)."""
    spec = models.get(name)
    ref, model = _build(spec, dtype, lora=lora), _build(spec, dtype, lora=lora, mlp_chunk=256)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    layers = spec.config().num_hidden_layers
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(3):
        b = _batch(spec, step)
        (ref_loss, ref_grads), (loss, grads) = _step(ref, b), _step(model, b)
        assert loss == pytest.approx(ref_loss, rel=tol), step
        assert set(grads) == set(ref_grads) and any("mlp.down_proj.lora_A" in n for n in grads)
        for n, g in ref_grads.items():
            err = ((grads[n] - g).norm() / g.norm()).item()
            assert err < tol, (step, n, err)
        opt.step()
        with torch.no_grad():  # the next step on the same weights
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q)
    # each step: the forward and the checkpoint's recompute, per layer; torch's checkpoint reads
    # what it recomputes, so nothing is skipped
    assert M.describe(model) == {"mlp_chunk": 256, "chunked_mlps": layers, "tail_mlps": layers,
                                 "chunked_calls": 2 * 3 * layers, "recompute_skips": 0}


class _MLP(nn.Module):
    def __init__(self, d=32, inter=96, bias=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, inter, bias=bias), nn.Linear(d, inter, bias=bias)
        self.down_proj = nn.Linear(inter, d, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _peft_mlp(bias=False, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_MLP(bias=bias).to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=list(M._PROJ)))
    return randomize_lora_b(model, seed=1)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)).sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("bias", [False, True])
def test_one_mlp_with_lora_and_biases_matches_and_keeps_only_its_input(bias):
    x = torch.randn(3, 70, 32)  # 210 tokens: chunks of 256 would not split them
    model = _peft_mlp(bias)
    ref_y, ref_g = _grads(model, x)
    M.enable(model, mlp_chunk=256)
    assert M.describe(model)["chunked_mlps"] == 1
    vars(model.base_model.model)["_optim_mlp_chunk"] = 64  # below the switch's choices: 4 chunks, a tail of 18
    y, g = _grads(model, x)
    assert M.describe(model)["chunked_calls"] == 1
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)
    assert g.keys() == ref_g.keys() and len(g) == 7  # x and A, B of the three projections
    for n in g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-4, atol=1e-6, msg=n)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.numel():
            saved.append(t)
        return t

    xg = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(xg)
    assert len(saved) == 1 and saved[0] is xg  # the input, and no tokens x intermediate tensor


def test_what_it_cannot_chunk_runs_the_mlps_own_forward():
    x = torch.randn(2, 300, 32)
    # a trained base weight, a GELU MLP, a batch within one chunk (with grad and without)
    trained = _peft_mlp()
    trained.base_model.model.gate_proj.base_layer.weight.requires_grad_(True)
    gelu = _MLP()
    gelu.act_fn = nn.GELU()
    for model, arg, grad in ((trained, x, True), (gelu, x, True), (_peft_mlp(), x[:, :100], True),
                             (_peft_mlp(), x[:, :100], False)):
        M.enable(model, mlp_chunk=256)
        with torch.set_grad_enabled(grad):
            model(arg)
        assert M.describe(model).get("chunked_calls", 0) == 0
    assert M.describe(gelu)["chunked_mlps"] == 0


def test_enable_disable_keep_parameters_and_state_dict_and_the_switch_reads_its_env_var(monkeypatch):
    spec = models.get("qwen3-0.6b-tiny")
    model = _build(spec, torch.float32)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    monkeypatch.setenv("OPTIM_MLP_CHUNK", "512")
    optim.enable(model, only=("mlp",))
    assert M.describe(model)["mlp_chunk"] == 512 and M.describe(model)["chunked_mlps"] == 2
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    optim.disable(model)
    assert M.describe(model) == {} and not any(type(m).__name__.startswith("Chunked") for m in model.modules())
    monkeypatch.delenv("OPTIM_MLP_CHUNK")
    optim.enable(model, only=("mlp",))
    assert M.describe(model) == {"mlp_chunk": "off", "chunked_mlps": 0, "tail_mlps": 0, "chunked_calls": 0,
                                 "recompute_skips": 0}
    with pytest.raises(ValueError, match="mlp_chunk=100 is not valid"):
        optim.enable(model, mlp_chunk=100)


class _Widest(torch.utils._python_dispatch.TorchDispatchMode):
    """The most tokens of any tensor an op makes whose last dimension is ``width``."""

    def __init__(self, width):
        super().__init__()
        self.width, self.most = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width:
                self.most = max(self.most, t.numel() // self.width)
        return out


def test_without_grad_and_under_offload_no_tokens_x_intermediate_tensor_is_made():
    """optim.offload runs each checkpointed layer's forward under no_grad and recomputes it in the
    backward: there too the MLP runs in chunks, so no op makes a tensor of more tokens than a chunk
    at the intermediate width (the MLP's own forward makes gate(x), up(x) and their product whole);
    the loss and gradients stay those of the same offloaded model unchunked, at each of three steps
    (2 x 600 tokens: chunks of 256 and a tail). In offload's recompute the MLP's output is read by
    nothing (Qwen3's layer adds it to the residual and returns): there it computes nothing."""
    spec = models.get("qwen3-0.6b-tiny")
    inter = spec.config().intermediate_size
    x = torch.randn(2, 300, 32)
    model = _peft_mlp()
    ref = model(x).detach()
    M.enable(model, mlp_chunk=256)
    with torch.no_grad(), _Widest(96) as seen:
        y = model(x)
    assert M.describe(model)["chunked_calls"] == 1 and seen.most == 256
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():  # generation's mode: nothing saved, nothing refused
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
    assert M.describe(model)["chunked_calls"] == 2

    def build(**switches):
        m = randomize_lora_b(models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4), seed=3)
        return optim.enable(m, only=("lora", "mlp", "offload"), offload="double", **switches)

    ref, model = build(), build(mlp_chunk=256)
    with torch.no_grad():  # an evaluation asking for hidden states installs transformers' capture hooks
        model(input_ids=_batch(spec).input_ids, output_hidden_states=True, use_cache=False)
    assert any(layer._forward_hooks for layer in model.modules() if type(layer).__name__ == "Qwen3DecoderLayer")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    layers = spec.config().num_hidden_layers
    for step in range(3):  # each step, the first included, on the weights the reference reached
        b = _batch(spec, step)
        ref_loss, ref_grads = _step(ref, b)
        with _Widest(inter) as seen:
            loss, grads = _step(model, b)
        assert seen.most == 256, (step, seen.most)
        assert loss == pytest.approx(ref_loss, rel=1e-5), step
        assert set(grads) == set(ref_grads) and any("mlp.down_proj.lora_A" in n for n in grads)
        for n, g in ref_grads.items():
            assert ((grads[n] - g).norm() / g.norm()).item() < 1e-5, (step, n)
        opt.step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q)
    seen = M.describe(model)  # the evaluation, then per step the no_grad forward and the recompute, which skips
    assert (seen["chunked_calls"], seen["recompute_skips"], seen["tail_mlps"]) == (layers + 3 * 2 * layers, 3 * layers, layers)


class _NormedTail(nn.Module):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)  # reads the MLP's output
        hidden_states = residual + hidden_states
        return hidden_states


class _Tail(nn.Module):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)  # a comment does not matter
        hidden_states = residual + hidden_states

        return hidden_states


def test_only_a_layer_that_adds_the_mlp_output_to_the_residual_and_returns_skips_it():
    """The skip is read from the layer's source: an MLP output that anything else reads (a norm
    after it, as in Gemma 2; a multiplier, as in Granite) is computed in the recompute as always."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer
    from transformers.models.granite.modeling_granite import GraniteDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    assert M._residual_tail(_Tail) and M._residual_tail(LlamaDecoderLayer) and M._residual_tail(MistralDecoderLayer)
    assert not any(M._residual_tail(c) for c in (_NormedTail, Gemma2DecoderLayer, GraniteDecoderLayer, nn.Linear))


def test_an_mlp_without_adapters_chunks_in_inference_mode_and_then_trains():
    """Projections without LoRA pass an empty stand-in for their adapters; one made first under
    inference_mode would be an inference tensor, refused by every later backward. Under autocast
    the MLP's own forward runs (its dtypes are autocast's to choose)."""
    torch.manual_seed(0)
    model = _MLP()
    model.requires_grad_(False)
    x = torch.randn(2, 300, 32)
    ref = model(x)
    M.enable(model, mlp_chunk=256)
    M._NONE.cache.clear()  # as in a fresh process: the first call makes the stand-in
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()  # saves the stand-in for its backward
    assert xg.grad is not None and M.describe(model)["chunked_calls"] == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    assert M.describe(model)["chunked_calls"] == 2


def test_under_autocast_to_the_inputs_dtype_the_mlp_chunks_as_without_it():
    """Trainer's bf16=True over a bf16 model: the chunked function runs under that autocast and
    gives what it gives without autocast, to the bit; autocast to another dtype keeps the MLP's own
    forward."""
    torch.manual_seed(0)
    model = _MLP().to(torch.bfloat16)
    model.requires_grad_(False)
    M.enable(model, mlp_chunk=256)
    x = torch.randn(2, 300, 32).to(torch.bfloat16).requires_grad_(True)
    off = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = model(x)
    assert torch.equal(on, off) and M.describe(model)["chunked_calls"] == 2
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)
    assert M.describe(model)["chunked_calls"] == 2


def _tail_layer(seed):
    torch.manual_seed(seed)
    layer = _Tail()
    layer.mlp = _MLP()
    layer.mlp.requires_grad_(False)
    return layer


class _ReadsOutput(nn.Module):
    """Two tail-shaped layers in one checkpointed block: the first one's output is the second's input."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _tail_layer(1), _tail_layer(2)

    def forward(self, hidden_states):
        return self.b(self.a(hidden_states))


def _then_norm(layer, hidden_states):
    return torch.nn.functional.rms_norm(layer(hidden_states), (32,))  # reads the layer's output


def _alpha_hook(module):
    """A forward hook that reads the output and scales it by a trained factor."""
    module.alpha = nn.Parameter(torch.tensor(0.7))
    module.register_forward_hook(lambda m, i, o: torch.tanh(o) * m.alpha)


def _instance_forward(module):
    orig = module.forward
    module.forward = lambda h: torch.tanh(orig(h))


@pytest.mark.parametrize("block,skips", [("layer", 1), ("bound", 1), ("partial", 1), ("partial call", 1),
                                         ("two layers", 0), ("then norm", 0), ("layer hook", 0),
                                         ("layer instance forward", 0), ("mlp hook", 0),
                                         ("mlp instance forward", 0)])
def test_under_a_standalone_offloader_only_the_recomputed_layers_own_mlp_skips(block, skips):
    """The skip holds only when the callable recomputed is the tail-shaped layer's call itself and
    nothing but the classes' forwards sees the outputs: in a block of two layers, a function that
    norms the layer's output, a forward hook or a forward set on the layer or the MLP, the output is
    read, and the MLP computes. Either way the gradients are those without checkpoints."""
    import functools

    import optim.offload as oo
    from optim._recomputing import module_of

    model = _ReadsOutput() if block == "two layers" else _tail_layer(1)
    M.enable(model, mlp_chunk=256)  # the reference too runs the chunks: without a recompute, none skips
    {"layer hook": lambda: _alpha_hook(model), "mlp hook": lambda: _alpha_hook(model.mlp),
     "layer instance forward": lambda: _instance_forward(model),
     "mlp instance forward": lambda: _instance_forward(model.mlp)}.get(block, lambda: None)()
    # "partial" and "partial call": what transformers' checkpointed layers pass, by version
    call = {"layer": model, "bound": model.forward, "partial": functools.partial(type(model).forward, model),
            "partial call": functools.partial(super(type(model), model).__call__),
            "two layers": model, "then norm": functools.partial(_then_norm, model)}.get(block, model)
    assert module_of(call) is (None if block == "then norm" else model)
    x = torch.randn(2, 600, 32, requires_grad=True)  # 1200 tokens: four chunks of 256 and a tail
    w = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    (call(x) * w).sum().backward()
    ref = [t.grad for t in (x, *params)]
    for t in (x, *params):
        t.grad = None
    assert M.describe(model)["recompute_skips"] == 0
    off = oo.Offloader("double", min_bytes=0)
    (off(call, x) * w).sum().backward()
    for got, want in zip([t.grad for t in (x, *params)], ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert M.describe(model)["recompute_skips"] == skips


class _TailInBranch(nn.Module):
    def forward(self, hidden_states, flag=False):
        residual = hidden_states
        if flag:
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states
        else:
            hidden_states = self.norm(self.mlp(hidden_states))
            hidden_states = residual + hidden_states
            return hidden_states


class _TwoCalls(nn.Module):
    def forward(self, hidden_states):
        residual = hidden_states + self.mlp(hidden_states)  # an earlier call whose output is read
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def test_the_tail_is_the_last_top_level_statements_with_one_mlp_call():
    """Read from the syntax tree, not from lines: the tail inside a branch, or a second call of the
    MLP whose output is read, is no tail."""
    assert M._residual_tail(_Tail)
    assert not M._residual_tail(_TailInBranch) and not M._residual_tail(_TwoCalls)


def test_regional_compiles_checkpoint_body_is_recognised_as_the_layers_own_call():
    """With transformers >= 5.23 optim.regional hands the checkpoint its compiled body in place of
    the layer's forward: the recompute is still the layer's own call, so its MLP may skip."""
    import functools

    from optim import regional
    from optim._recomputing import module_of

    spec = models.get("qwen3-0.6b-tiny")
    built = models.build(spec, device="cpu", dtype=torch.float32)
    layer = next(m for m in built.modules() if type(m).__name__ == "Qwen3DecoderLayer")
    call = regional._LayerCall(layer, regional.CompileState(mode=None))
    if call.body is None:
        pytest.skip("transformers < 5.23 checkpoints the layer's call, not a body inside its forward")
    seen = []
    call._with_compiled_body(lambda fn, *a, **k: seen.append(fn))(functools.partial(call.body, layer, position_ids=None))
    assert seen[0].func == call._body and module_of(seen[0]) is layer
    assert module_of(functools.partial(call._body, layer, 1)) is None  # an argument bound before: not a plain call
