"""Experiment files: valid ones expand into points; every malformed one fails before anything
runs, with one error naming the file, the key and the valid choices."""

import tomllib
from pathlib import Path

import pytest

from harness.run import experiment
from harness.run.experiment import ExperimentError

VALID = """
[experiment]
name = "t"
models = ["Qwen3-0.6B-tiny", "llama-3.2-1b-tiny"]
seq_lens = [64, 128]
batch_size = 2
[variants.a]
attn_implementation = "sdpa"
[variants.b]
attn_implementation = "eager"
gradient_checkpointing = false
"""


def test_valid_file_expands_to_points(write_toml):
    exp = experiment.load(write_toml(VALID))
    points = exp.points()
    assert len(points) == 2 * 2 * 2
    assert exp.models == ["qwen3-0.6b-tiny", "llama-3.2-1b-tiny"]  # canonical names
    assert exp.baseline_variant == "a"  # first variant by default
    b = [p for p in points if p.variant == "b"][0]
    assert b.switches["gradient_checkpointing"] is False
    assert points[0].switches["gradient_checkpointing"] is True  # default filled in
    assert len({p.point_id for p in points}) == len(points)
    # identity is stable and survives a JSON round trip to the child process
    again = experiment.load(write_toml(VALID)).points()
    assert [p.point_id for p in again] == [p.point_id for p in points]
    assert experiment.SweepPoint.from_json(points[3].to_json()) == points[3]


def test_timeout_does_not_change_point_identity(write_toml):
    a = experiment.load(write_toml(VALID)).points()
    b = experiment.load(write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\ntimeout_s = 5'))).points()
    assert [p.point_id for p in a] == [p.point_id for p in b]


@pytest.mark.parametrize(
    "edit, key, fragment",
    [
        (("name = \"t\"", "name = \"t\"\nbogus = 1"), "experiment.bogus", "valid: "),
        (("Qwen3-0.6B-tiny", "qwen9-tiny"), "experiment.models[0]", "gpt-oss-20b"),
        (('attn_implementation = "sdpa"', 'attn_implementation = "flash9"'), "variants.a.attn_implementation", "flex_attention"),
        (('attn_implementation = "sdpa"', 'turbo = true'), "variants.a.turbo", "gradient_checkpointing"),
        (("seq_lens = [64, 128]", "seq_lens = []"), "experiment.seq_lens", "non-empty"),
        (("seq_lens = [64, 128]", "seq_lens = [64, \"x\"]"), "experiment.seq_lens[1]", "integer"),
        (("seq_lens = [64, 128]", "seq_lens = [64, 10000000]"), "experiment.seq_lens", "max_position_embeddings"),
        (("batch_size = 2", "batch_size = 0"), "experiment.batch_size", ">= 1"),
        (("batch_size = 2", "batch_size = 2\nwarmup_steps = 1"), "experiment.warmup_steps", ">= 3"),
        (("batch_size = 2", "batch_size = 2\nmeasured_steps = 5"), "experiment.measured_steps", ">= 10"),
        (("batch_size = 2", "batch_size = 2\nlora_rank = 100000"), "experiment.lora_rank", "hidden size"),
        (("batch_size = 2", "batch_size = 2\ngpus = 2"), "experiment.parallel", "2 GPUs per point shard the model"),
        (("batch_size = 2", "batch_size = 2\nbaseline = \"zzz\""), "experiment.baseline", "valid: a, b"),
        (("batch_size = 2", "batch_size = 2\ndtype = \"fp8\""), "experiment.dtype", "bf16"),
        # no limit at all is no time limit: nan and inf are refused, as 0 is
        (("batch_size = 2", "batch_size = 2\ntimeout_s = nan"), "experiment.timeout_s", "above 0"),
        (("batch_size = 2", "batch_size = 2\ntimeout_s = inf"), "experiment.timeout_s", "above 0"),
        # a repeated length or model is one point swept twice under one id
        (("seq_lens = [64, 128]", "seq_lens = [64, 64]"), "experiment.seq_lens[1]", "listed twice"),
        (("\"Qwen3-0.6B-tiny\"", "\"Qwen3-0.6B-tiny\", \"qwen3-0.6b-tiny\""), "experiment.models[1]", "listed twice"),
        # the name is a folder under results/: no way out of it
        (("name = \"t\"", "name = \"..\""), "experiment.name", "letters, digits"),
        (("name = \"t\"", "name = \"t\\n\""), "experiment.name", "letters, digits"),
    ],
)
def test_malformed_file_names_file_key_and_choices(write_toml, edit, key, fragment):
    path = write_toml(VALID.replace(*edit))
    with pytest.raises(ExperimentError) as info:
        experiment.load(path)
    msg = str(info.value)
    assert str(path) in msg
    assert f"[{key}]" in msg
    assert fragment in msg


def test_not_toml(write_toml):
    path = write_toml("[experiment\nname=")
    with pytest.raises(ExperimentError, match="not valid TOML") as info:
        experiment.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ExperimentError, match="file not found"):
        experiment.load(tmp_path / "nope.toml")


def test_missing_required_key(write_toml):
    with pytest.raises(ExperimentError, match=r"\[experiment.models\] missing"):
        experiment.load(write_toml('[experiment]\nname = "x"\nseq_lens = [64]\n'))


def test_shipped_experiments_parse():
    from harness.cli import EXPERIMENTS

    files = sorted(EXPERIMENTS.glob("*.toml"))
    assert {f.name for f in files} >= {"smoke-cpu.toml", "smoke-gpu.toml"}
    plans = {f for f in files if f.read_text().lstrip().startswith("#") and "\n[blog]" in f.read_text()}
    assert {f.name for f in plans} == {"blog.toml"}  # a report plan, checked by tests/test_blog.py
    for f in set(files) - plans:
        assert experiment.load(f).points()


def test_subset_keeps_point_identity_and_rejects_unknown(write_toml):
    exp = experiment.load(write_toml(VALID))
    sub = experiment.subset(exp, models=["LLAMA-3.2-1B-tiny"], seq_lens=[128], variants=["b"])
    (point,) = sub.points()
    full = {p.point_id for p in exp.points()}
    assert point.point_id in full and point.model == "llama-3.2-1b-tiny" and point.variant == "b"
    with pytest.raises(ExperimentError, match=r"\[experiment.seq_lens\] 999 is not in this experiment \(valid: 64, 128\)"):
        experiment.subset(exp, seq_lens=[999])


LOSS_BASE = """
[experiment]
name = "l"
models = ["llama-3.2-1b-tiny"]
seq_lens = [32]
device = "cpu"
[variants.a]
attn_implementation = "sdpa"
"""


def test_loss_option(write_toml):
    base = LOSS_BASE
    full = experiment.load(write_toml(base))
    chunked = experiment.load(write_toml(base.replace('device = "cpu"', 'device = "cpu"\nloss = "chunked"')))
    assert full.loss == "full" and chunked.loss == "chunked"
    (p_full,), (p_chunked,) = full.points(), chunked.points()
    assert p_full.point_id != p_chunked.point_id  # a different measurement, a different identity
    assert p_full.loss_mode == "full" and p_chunked.loss_mode == "chunked"
    with pytest.raises(experiment.ExperimentError, match="experiment.loss"):
        experiment.load(write_toml(base.replace('device = "cpu"', 'device = "cpu"\nloss = "fused"')))


def test_variant_loss_overrides_the_experiment(write_toml):
    base = LOSS_BASE + """[variants.b]
attn_implementation = "sdpa"
loss = "chunked"
"""
    exp = experiment.load(write_toml(base))
    a, b = exp.points()
    assert (a.loss_mode, b.loss_mode) == ("full", "chunked")
    assert "loss" not in b.switches  # a harness option, not a model switch
    # variant a keeps the identity it had before variants could set a loss
    (alone,) = experiment.load(write_toml(base.split("[variants.b]")[0])).points()
    assert a.point_id == alone.point_id
    with pytest.raises(experiment.ExperimentError, match=r"variants.b.loss"):
        experiment.load(write_toml(base.replace('loss = "chunked"', 'loss = "fused"')))


def _points_keep_identity_without(write_toml, base: str, key_line: str) -> dict:
    """The points of ``base`` by variant, after checking that a per-variant key left unset keeps
    the identity points had before the key existed: variant a (without it) keeps its point_id,
    variant b (with ``key_line``) gets a new one."""
    pts = {p.variant: p for p in experiment.load(write_toml(base)).points()}
    plain = experiment.load(write_toml(base.replace(key_line, ""))).points()
    assert pts["a"].point_id == plain[0].point_id and pts["b"].point_id != plain[1].point_id
    return pts


def test_lora_dtype_per_experiment_and_variant_and_identity(write_toml):
    base = """
[experiment]
name = "ld"
models = ["llama-3.2-1b-tiny"]
seq_lens = [128]
device = "cpu"
dtype = "fp32"
[variants.a]
attn_implementation = "sdpa"
[variants.b]
attn_implementation = "sdpa"
lora_dtype = "model"
"""
    pts = _points_keep_identity_without(write_toml, base, 'lora_dtype = "model"\n')
    assert (pts["a"].lora_dtype, pts["b"].lora_dtype) == ("fp32", "model")
    with pytest.raises(experiment.ExperimentError) as e:
        experiment.load(write_toml(base.replace('lora_dtype = "model"', 'lora_dtype = "fp8"')))
    assert "variants.b.lora_dtype" in str(e.value) and "model" in str(e.value)


def test_cuda_graph_per_variant_keeps_identity_and_refuses_what_cannot_be_captured(write_toml):
    base = """
[experiment]
name = "cg"
models = ["llama-3.2-1b-tiny"]
seq_lens = [128]
device = "cuda"
[variants.a]
attn_implementation = "sdpa"
[variants.b]
attn_implementation = "sdpa"
cuda_graph = true
"""
    pts = _points_keep_identity_without(write_toml, base, "cuda_graph = true\n")
    assert (pts["a"].cuda_graph, pts["b"].cuda_graph) == (False, True)
    for edit, fragment in [
        (('device = "cuda"', 'device = "cpu"'), "needs device = 'cuda'"),
        (("cuda_graph = true", "cuda_graph = 1"), "must be true or false"),
        (("cuda_graph = true", 'cuda_graph = true\noffload = "double"'), "offload = 'none'"),
        (("cuda_graph = true", 'cuda_graph = true\npacking_backend = "varlen"'), "distribution = 'fixed'"),
    ]:
        with pytest.raises(ExperimentError) as e:
            experiment.load(write_toml(base.replace(*edit)))
        assert "variants.b.cuda_graph" in str(e.value) and fragment in str(e.value)
    # flex replays batches of varying document lengths: the capture reads them from position_ids
    experiment.load(write_toml(base.replace("cuda_graph = true", 'cuda_graph = true\npacking_backend = "flex"')))


def test_report_tables_name_variants_of_the_file(tmp_path):
    from harness.run import experiment as ex

    text = (Path(__file__).parents[1] / "experiments" / "packing.toml").read_text()
    ok = ex.parse(tomllib.loads(text))
    assert ok.report["packing"]["stock"] == "stock-flex"
    # renaming the variant without its [report] reference fails at load, naming the key
    renamed = text.replace("[variants.stock-flex]", "[variants.stock-flex-v2]").replace(
        'baseline = "stock-flex"', 'baseline = "stock-flex-v2"')
    with pytest.raises(ex.ExperimentError, match=r"\[report.packing.stock\].*stock-flex-v2"):
        ex.parse(tomllib.loads(renamed))
    with pytest.raises(ex.ExperimentError, match=r"\[report.pakcing\] unknown report section"):
        ex.parse(tomllib.loads(text.replace("[report.packing]", "[report.pakcing]")))
    with pytest.raises(ex.ExperimentError, match=r"\[report.packing.speedupp\] unknown key"):
        ex.parse(tomllib.loads(text.replace("\nspeedup = ", "\nspeedupp = ")))


def test_requires_names_the_package_the_environment_lacks_and_nothing_runs(write_toml, tmp_path, capsys):
    from harness import cli

    ok = experiment.load(write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\nrequires = { torch = ">=2.0" }')))
    assert ok.requires == {"torch": ">=2.0"}
    experiment.check_requires(ok)  # installed, in range: nothing raised
    assert [p.point_id for p in ok.points()] == [p.point_id for p in experiment.load(write_toml(VALID)).points()]
    newer = experiment.load(write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\nrequires = { transformers = ">=99" }')))
    with pytest.raises(ExperimentError, match=r"experiment.requires.transformers.*needs transformers>=99, this environment has \d"):
        experiment.check_requires(newer)
    absent = experiment.load(write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\nrequires = { no-such-pkg = "==1" }')))
    with pytest.raises(ExperimentError, match="this environment has none installed"):
        experiment.check_requires(absent)
    with pytest.raises(ExperimentError, match="experiment.requires.peft.*not a version specifier"):
        experiment.load(write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\nrequires = { peft = "newest" }')))
    path = write_toml(VALID.replace('batch_size = 2', 'batch_size = 2\nrequires = { transformers = ">=99" }'), "newer.toml")
    assert cli.main(["sweep", str(path), "--results", str(tmp_path / "res"), "--no-report"]) == 2
    assert "needs transformers>=99" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()  # refused before anything was written


GATE = VALID.replace('gradient_checkpointing = false\n', 'gradient_checkpointing = false\nmodels = ["llama-3.2-1b-tiny"]\n') + """
[variants.cache]
packing_backend = "sdpa"
packing_cache = true
[variants.nocache]
packing_backend = "sdpa"
packing_cache = false
[gate]
rounds = 6
max_slowdown = "3%"
[[gate.guards]]
switch = "packing_cache"
model = "qwen3-0.6b-tiny"
seq_len = 64
on = "cache"
off = "nocache"
min_speedup = 1.1
"""


def test_variant_models_and_gate_suite(write_toml):
    exp = experiment.load(write_toml(GATE))
    b = [p for p in exp.points() if p.variant == "b"]
    assert {p.model for p in b} == {"llama-3.2-1b-tiny"} and len(exp.points()) == 3 * 4 + 2
    assert exp.gate.rounds == 6 and exp.gate.max_slowdown == 0.03 and exp.gate.alpha == 0.01
    (g,) = exp.gate.guards
    assert (g.switch, g.on, g.off, g.min_speedup, g.parity) == ("packing_cache", "cache", "nocache", 1.1, True)
    assert g.param_tol == 0.25
    assert experiment.load(write_toml(VALID)).gate is None
    tuned = experiment.load(write_toml(GATE.replace("min_speedup = 1.1", "min_speedup = 1.1\nparam_tol = 0.4")))
    assert tuned.gate.guards[0].param_tol == 0.4
    with pytest.raises(experiment.ExperimentError, match="param_tol"):  # 1 or more lets a dropped gradient pass
        experiment.load(write_toml(GATE.replace("min_speedup = 1.1", "min_speedup = 1.1\nparam_tol = 1.0")))


def test_a_variant_runs_at_its_own_lengths_and_a_guard_needs_its_pair_there(write_toml):
    """variants.<v>.seq_lens: the variant's points at those of the file's lengths only (a gate suite
    judges its user points at a length the GPU's time dominates); the other points keep their ids."""
    whole = experiment.load(write_toml(GATE))
    text = GATE.replace('[variants.cache]\n', '[variants.cache]\nseq_lens = [64]\n')
    exp = experiment.load(write_toml(text))
    assert {p.seq_len for p in exp.points() if p.variant == "cache"} == {64}
    assert {p.seq_len for p in exp.points() if p.variant == "nocache"} == {64, 128}
    kept = {p.point_id for p in whole.points()}
    assert {p.point_id for p in exp.points()} == kept - {p.point_id for p in whole.points()
                                                          if p.variant == "cache" and p.seq_len == 128}
    with pytest.raises(ExperimentError) as err:  # the guard's pair at 128: 'on' does not run there
        experiment.load(write_toml(text.replace("seq_len = 64\non", "seq_len = 128\non")))
    assert err.value.key == "gate.guards[0].on" and "does not run at 128 tokens" in str(err.value)


@pytest.mark.parametrize("value, key, fragment", [
    ("[256]", "variants.cache.seq_lens[0]", "256 is not one of [experiment] seq_lens"),
    ("[]", "variants.cache.seq_lens", "non-empty list"),
    ("64", "variants.cache.seq_lens", "non-empty list"),
    ('["64"]', "variants.cache.seq_lens[0]", "not one of"),
])
def test_malformed_variant_seq_lens(write_toml, value, key, fragment):
    with pytest.raises(ExperimentError) as err:
        experiment.load(write_toml(GATE.replace('[variants.cache]\n', f'[variants.cache]\nseq_lens = {value}\n')))
    assert err.value.key == key and fragment in str(err.value), str(err.value)


def test_the_gate_judges_by_role_or_by_name(write_toml):
    """judge = ["user"] picks every variant of the user's path, each on its own models; a name picks
    one variant; the optim.enable guard reads the roles (user against stock)."""
    text = GATE.replace("[variants.cache]", """[variants.user-dense]
role = "user"
[variants.user-moe]
role = "user"
models = ["llama-3.2-1b-tiny"]
[variants.cache]""").replace("rounds = 6", 'rounds = 6\njudge = ["user", "nocache"]')
    exp = experiment.load(write_toml(text))
    assert exp.gate.judge == ("user-dense", "user-moe", "nocache")
    judged = exp.gate.variants_for("base", 1, list(exp.variants))
    assert judged == ["user-dense", "user-moe", "nocache"]
    assert {p.model for p in exp.points() if p.variant == "user-moe"} == {"llama-3.2-1b-tiny"}
    guard = text.replace('switch = "packing_cache"', 'switch = "optim.enable"').replace(
        'on = "cache"', 'on = "user-dense"').replace('off = "nocache"', 'off = "a"')
    with pytest.raises(ExperimentError, match="'off' role 'stock'"):  # a variant without a role is not stock
        experiment.load(write_toml(guard))
    guard = guard.replace('[variants.a]\n', '[variants.a]\nrole = "stock"\n')
    (g,) = experiment.load(write_toml(guard)).gate.guards
    assert (g.on, g.off) == ("user-dense", "a")
    with pytest.raises(ExperimentError, match="'off' role 'stock'"):
        experiment.load(write_toml(guard.replace('off = "a"', 'off = "user-dense"')))


@pytest.mark.parametrize("edit, key, fragment", [
    (('models = ["llama-3.2-1b-tiny"]', 'models = ["qwen3-8b"]'), "variants.b.models[0]", "not one of [experiment] models"),
    (('switch = "packing_cache"', 'switch = "packing_cash"'), "gate.guards[0].switch", "not a valid choice"),
    (('off = "nocache"', 'off = "cache"'), "gate.guards[0].switch", "set packing_cache alike"),
    (('on = "cache"', 'on = "zzz"'), "gate.guards[0].on", "not a valid choice"),
    (('on = "cache"', 'on = "b"'), "gate.guards[0].on", "does not run on qwen3-0.6b-tiny"),
    (('seq_len = 64\non', 'seq_len = 99\non'), "gate.guards[0].seq_len", "not a valid choice"),
    (("min_speedup = 1.1", "min_speedup = 0"), "gate.guards[0].min_speedup", "above 0"),
    (("min_speedup = 1.1", ""), "gate.guards[0].min_speedup", "missing required key"),
    (("rounds = 6", "rounds = 1"), "gate.rounds", ">= 2"),
    (("rounds = 6", "alpha = 0.7"), "gate.alpha", "below 0.5"),
    (('max_slowdown = "3%"', "max_slowdown = 5"), "gate.max_slowdown", "ambiguous"),
    (("rounds = 6", "wobble = 1"), "gate.wobble", "unknown key"),
    (('switch = "packing_cache"', 'switch = "optim.enable"'), "gate.guards[0].switch", "role 'user'"),
    (("rounds = 6", 'rounds = 6\njudge = ["zz"]'), "gate.judge[0]", "not a valid choice"),
    (("rounds = 6", 'rounds = 6\njudge = ["peer"]'), "gate.judge[0]", "no variant plays role 'peer'"),
    (("rounds = 6", 'rounds = 6\njudge = "cache"'), "gate.judge", "a list of roles or variant names"),
    (("rounds = 6", "rounds = 6\nguard_rounds = 7"), "gate.guard_rounds", "at most rounds (6)"),
])
def test_malformed_gate_suite(write_toml, edit, key, fragment):
    text = GATE.replace(*edit)
    assert text != GATE
    with pytest.raises(ExperimentError) as err:
        experiment.load(write_toml(text))
    assert err.value.key == key and fragment in str(err.value), str(err.value)


def test_optim_variables_in_the_environment_enter_the_point_identity(write_toml, monkeypatch):
    """OPTIM_<NAME> fills every switch a variant leaves out, so a sweep resumed in a shell that sets
    one measures again instead of counting the other shell's rows as done."""
    import os

    for k in [k for k in os.environ if k.startswith("OPTIM_")]:
        monkeypatch.delenv(k)
    plain = experiment.load(write_toml(VALID)).points()
    assert all(p.env_switches == {} for p in plain)
    monkeypatch.setenv("OPTIM_PACKING_CACHE", "false")
    monkeypatch.setenv("OPTIM_NOT_A_SWITCH", "1")  # optim reads no such variable
    pts = experiment.load(write_toml(VALID)).points()
    assert pts[0].env_switches == {"OPTIM_PACKING_CACHE": "false"}
    assert not {p.point_id for p in plain} & {p.point_id for p in pts}
    r = pts[0].new_row().to_dict()
    assert r["env_switches"] == {"OPTIM_PACKING_CACHE": "false"} and r["point_id"] == pts[0].point_id
    assert experiment.SweepPoint.from_json(pts[0].to_json()) == pts[0]


@pytest.mark.parametrize("sigma", ['"abc"', '"1.5"', "true", "nan", "inf", "-0.5"])
def test_a_data_sigma_that_is_no_finite_number_is_refused(write_toml, sigma):
    with pytest.raises(ExperimentError, match=r"\[data.sigma\] must be a finite number >= 0"):
        experiment.load(write_toml(VALID + f"[data]\nsigma = {sigma}\n"))
    assert experiment.load(write_toml(VALID + "[data]\nsigma = 0.5\n")).data.sigma == 0.5
