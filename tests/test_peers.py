"""The variants a user and a peer would run (``stack = "user" | "liger" | "compiled"``): parsed, identified
and run as they say, and a peer that cannot run here is a ``skipped`` row, not an error."""

import pytest
import torch

from harness import gate
from harness import results as res
from harness.run import experiment, sweep
from harness.run.experiment import ExperimentError

BASE = """
[experiment]
name = "peers"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
device = "cpu"
dtype = "fp32"
lora_rank = 2
timeout_s = 120
bandwidth = false
[data]
median_doc_len = 16
[variants.a]
attn_implementation = "sdpa"
[variants.b]
attn_implementation = "sdpa"
stack = "user"
"""


def test_stack_keeps_earlier_point_ids_and_is_in_the_new_ones(write_toml):
    pts = {p.variant: p for p in experiment.load(write_toml(BASE)).points()}
    plain = experiment.load(write_toml(BASE.replace('stack = "user"\n', ""))).points()
    assert pts["a"].point_id == plain[0].point_id and pts["b"].point_id != plain[1].point_id
    assert (pts["a"].stack, pts["b"].stack) == ("", "user")
    liger = experiment.load(write_toml(BASE.replace('"user"', '"liger"'))).points()[1]
    assert len({pts["b"].point_id, liger.point_id, plain[1].point_id}) == 3


@pytest.mark.parametrize("edit, key, fragment", [
    (('stack = "user"', 'stack = "deepspeed"'), "variants.b.stack", "'deepspeed' is not a valid choice"),
    (('stack = "user"', 'stack = "liger"\npacking_backend = "flex"'), "variants.b.stack",
     "'liger' runs without optim; drop the optim switch(es) ['packing_backend']"),
    (('stack = "user"', 'stack = "user"\nloss = "chunked"'), "variants.b.loss", "drop loss = 'chunked'"),
    (('stack = "user"', 'stack = "compiled"\ncompile_layers = true'), "variants.b.stack",
     "'compiled' runs without optim; drop the optim switch(es) ['compile_layers']"),
    (('stack = "user"', 'stack = "compiled"\nrole = "stock"'), "variants.b.role",
     "'stock' cannot be built by stack 'compiled', whose variants play stock-compiled"),
])
def test_malformed_stack_fails_at_load(write_toml, edit, key, fragment):
    text = BASE.replace(*edit)
    with pytest.raises(ExperimentError) as e:
        experiment.load(write_toml(text))
    assert key in str(e.value) and fragment in str(e.value)


def test_a_user_stack_takes_the_model_loss_whatever_the_experiment_default(write_toml):
    text = BASE.replace("bandwidth = false", 'bandwidth = false\nloss = "chunked"')
    pts = {p.variant: p for p in experiment.load(write_toml(text)).points()}
    assert (pts["a"].loss_mode, pts["b"].loss_mode) == ("chunked", "full")


def _run(tmp_path, write_toml, text):
    exp = experiment.load(write_toml(text))
    sweep.run(exp, tmp_path / "results", progress=False)
    return {r["variant"]: r for r in res.read_rows(res.results_path(tmp_path / "results", "peers", "cpu"))}


def test_user_stack_is_plain_optim_enable_and_liger_on_cpu_is_skipped(tmp_path, write_toml):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the liger point runs; tests/test_gpu_peers.py covers it")
    text = (BASE + '[variants.c]\nattn_implementation = "sdpa"\nstack = "liger"\n'
            '[variants.d]\nattn_implementation = "sdpa"\nstack = "compiled"\n')
    rows = _run(tmp_path, write_toml, text)
    assert all(rows[v]["status"] == "ok" for v in "abd"), {v: r.get("message") for v, r in rows.items()}
    # stock with compiled layers: no optim, the stock numerics (same weights, same batches)
    assert rows["d"]["optim"] == {} and (rows["d"]["role"], rows["d"]["stack"]) == ("stock-compiled", "compiled")
    assert rows["d"]["loss"] == pytest.approx(rows["a"]["loss"], rel=1e-4)
    assert rows["a"]["optim"] == {}
    # exactly what optim.enable(model) applies with no arguments: every module, every default
    import optim

    applied = set(optim.MODULES) - {"optim.offload"}  # off by default: it trades time for memory
    assert set(rows["b"]["optim"]) == applied
    # what the run did, read after it: every step's packed forwards (at enable time, none)
    steps = rows["b"]["warmup_steps"] + rows["b"]["measured_steps"]
    assert rows["b"]["optim"]["optim.packing"]["forwards"]["packed"] == steps
    from optim.offload import SWITCHES as offload_switches

    assert rows["b"]["switches_resolved"] == {k: sw.default for k, sw in optim.SWITCHES.items()
                                              if k not in offload_switches}
    assert rows["b"]["stack"] == "user"
    # the peer cannot run on a CPU: a row that says so, retried on resume, never an error
    assert rows["c"]["status"] == "skipped" and "need a CUDA GPU" in rows["c"]["message"]
    assert "skipped" not in res.FINISHED


def test_gate_warns_and_does_not_fail_when_a_peer_is_skipped_in_the_candidate():
    ok = gate.Side("ok", "", 1, 100.0, 0.01, None, 1.0)
    skipped = gate.Side("skipped", "Liger-Kernel is not installed", 1, None, None, None, None)
    p = gate.judge(gate.PointResult("liger", {}, "gpu", ok, skipped), 0.05, 0.05, "auto")
    assert (p.outcome, p.verdict) == ("warn", "skipped in the candidate")
    assert "not installed" in p.reasons[0]
    broken = gate.Side("error", "boom", 1, None, None, None, None)
    assert gate.judge(gate.PointResult("x", {}, "gpu", ok, broken), 0.05, 0.05, "auto").outcome == "fail"


def test_compiled_stack_compiles_every_decoder_layer_and_computes_what_stock_does():
    import copy

    from harness.run import peers
    from harness.workload import models

    spec = models.get("qwen3-0.6b-tiny")
    stock = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2)
    compiled = copy.deepcopy(stock)
    assert peers.compile_layers(compiled) == spec.num_hidden_layers
    layers = [m for m in compiled.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert len(layers) == spec.num_hidden_layers and all(m._compiled_call_impl is not None for m in layers)
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (stock, compiled):
        m.train()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append((loss.item(), [p.grad.clone() for p in m.parameters() if p.requires_grad]))
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-5)
    for g0, g1 in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    with pytest.raises(peers.PeerUnavailable, match="no transformers decoder layers"):
        peers.compile_layers(torch.nn.Linear(2, 2))


def test_compiled_stack_on_moe_experts_lora_compiles_once_and_trains_what_stock_does():
    # peft's target_parameters adapters make a new parametrized class at every call. Compiled inside
    # the layer, they recompile at every step until dynamo gives up (torch 2.11), so a checkpointed
    # layer's recompute runs other code than its forward; or the whole layer is skipped for a graph
    # break in a generator (later torch). The compiled stack leaves them eager: the layer is compiled
    # around them, nothing recompiles after the first step, and every step trains what stock does.
    import copy

    from torch._dynamo.utils import counters

    from harness.run import peers
    from harness.workload import models

    spec = models.get("gpt-oss-20b-tiny")
    stock = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=2, attn_implementation="eager",
                         experts_implementation="grouped_mm")
    models.randomize_lora_b(stock)
    compiled = copy.deepcopy(stock)
    torch._dynamo.reset()
    counters.clear()
    assert peers.compile_layers(compiled) == spec.num_hidden_layers
    ids = torch.randint(0, spec.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for step in range(3):
            out = []
            for m in (stock, compiled):
                m.zero_grad(set_to_none=True)
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                out.append((loss.item(), [p.grad.clone() for p in m.parameters() if p.requires_grad]))
            assert out[1][0] == pytest.approx(out[0][0], rel=1e-5), step
            for g0, g1 in zip(out[0][1], out[1][1]):
                torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    breaks = list(counters["graph_break"])
    assert counters["frames"]["ok"] > 0 and not [b for b in breaks if "Skipping frame" in b], breaks
    assert breaks and all("ParamWrapper" in b for b in breaks), breaks  # the layer breaks only around the adapters
    clone = copy.deepcopy(compiled)  # each model's adapters run its own weights
    wrappers = [(m, c) for m, c in zip(compiled.modules(), clone.modules()) if type(m).__name__ == "ParamWrapper"]
    assert wrappers and all(c.forward.__self__ is c and m.forward.__self__ is m for m, c in wrappers)


def test_an_unsloth_point_imports_it_before_torch_and_on_cpu_is_a_skipped_row(tmp_path, write_toml, unsloth_stand_in):
    # Unsloth patches transformers and peft at import: the point's process must import it first
    if torch.cuda.is_available():
        pytest.skip("on a GPU the unsloth point runs; tests/test_gpu_peers.py covers it")
    rows = _run(tmp_path, write_toml, BASE + '[variants.u]\nstack = "unsloth"\n')
    assert unsloth_stand_in.read_text() == "|1\n", "unsloth was imported after " + unsloth_stand_in.read_text()
    assert (rows["u"]["role"], rows["u"]["stack"]) == ("unsloth", "unsloth")
    assert rows["u"]["status"] == "skipped" and "Unsloth needs a CUDA GPU" in rows["u"]["message"]


def test_an_unsloth_point_where_it_cannot_import_says_why_and_how_to_install(monkeypatch):
    import sys

    from harness.run import peers, unsloth_stack

    monkeypatch.setitem(sys.modules, "unsloth", None)  # `import unsloth` raises ModuleNotFoundError
    monkeypatch.setattr(unsloth_stack, "IMPORT_ERROR", None)
    unsloth_stack.import_first()
    with pytest.raises(peers.PeerUnavailable, match=r"not installed.*pip install '\.\[unsloth\]'"):
        unsloth_stack.build(None, device=torch.device("cuda"), dtype=torch.bfloat16, lora_rank=16,
                            max_seq_length=64, gradient_checkpointing=True, seed=0)


def test_an_unsloth_point_it_would_not_compute_alike_is_a_skipped_row_that_says_why(monkeypatch):
    # an Unsloth that imported: the stack still refuses what it would build unlike the stacks beside it
    import sys
    import types

    from harness.run import peers, unsloth_stack
    from harness.workload import models

    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    with pytest.raises(peers.PeerUnavailable, match="reads one packed row a step"):
        unsloth_stack.build(models.get("qwen3-0.6b"), device=torch.device("cuda"), dtype=torch.bfloat16, lora_rank=16,
                            max_seq_length=64, gradient_checkpointing=True, seed=0, batch_size=4)
    # an MoE model is not refused up front: Unsloth adapts the fused experts as peft's build does
    unsloth_stack.check(models.get("gpt-oss-20b"), device=torch.device("cuda"), lora_rank=16, max_seq_length=64)


@pytest.mark.parametrize("model", ["gpt-oss-20b-tiny", "qwen3-0.6b-tiny"])
def test_unsloth_must_train_the_adapters_the_harness_trains_or_its_point_is_refused(model):
    from harness.run import peers, unsloth_stack
    from harness.workload import models

    spec = models.get(model)
    same = models.build(spec, device="meta", dtype=torch.bfloat16, lora_rank=8, gradient_checkpointing=False)
    unsloth_stack.same_adapters(same, spec, 8)  # the very adapters: accepted
    other_rank = models.build(spec, device="meta", dtype=torch.bfloat16, lora_rank=4, gradient_checkpointing=False)
    with pytest.raises(peers.PeerUnavailable, match=f"Unsloth's LoRA on {model} is not the harness's"):
        unsloth_stack.same_adapters(other_rank, spec, 8)
    fewer = models.build(spec, device="meta", dtype=torch.bfloat16, lora_rank=8, gradient_checkpointing=False)
    frozen = next(n for n, p in fewer.named_parameters() if p.requires_grad and ("expert" in n or "mlp" in n))
    fewer.get_parameter(frozen).requires_grad_(False)  # one adapter tensor left out, as an expert LoRA would be
    with pytest.raises(peers.PeerUnavailable, match=r"only the harness's: \{\("):
        unsloth_stack.same_adapters(fewer, spec, 8)


def test_the_unsloth_role_is_its_stack_runs_in_a_fresh_interpreter_and_on_one_gpu(write_toml):
    import dataclasses

    exp = experiment.load(write_toml(BASE + '[variants.u]\nrole = "unsloth"\n'))
    assert exp.variant_stack["u"] == "unsloth"  # the role alone builds with Unsloth, never the harness
    preloaded = dataclasses.replace(exp, launcher="preloaded")
    launchers = {p.variant: p.launcher for p in preloaded.points()}
    assert launchers == {"a": "preloaded", "b": "preloaded", "u": "process"}
    with pytest.raises(ExperimentError, match=r"variants\.u\.stack.*one GPU"):
        experiment.load(write_toml(BASE.replace('bandwidth = false', 'bandwidth = false\nparallel = "fsdp2"\ngpus = [2]')
                                   + '[variants.u]\nstack = "unsloth"\n'))


def test_a_liger_peer_for_a_family_liger_has_no_patches_for_is_unavailable_not_stock(monkeypatch):
    # Trainer(use_liger_kernel=True) logs and runs the stock model for such a family: no peer
    import sys
    import types

    from harness.run.peers import PeerUnavailable, liger_supports

    table = types.ModuleType("liger_kernel.transformers.monkey_patch")
    table.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": object()}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, table.__name__, table)
    liger_supports("llama")
    with pytest.raises(PeerUnavailable, match="no patches for model type 'mystery'"):
        liger_supports("mystery")
