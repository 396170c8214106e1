"""One role vocabulary: declared per variant in the experiment file, recorded in rows, read by the
report, its plots and the blog through harness.roles, older rows included."""

import json
from pathlib import Path

import pytest

from harness import roles
from harness.run import experiment
from harness.run.experiment import ExperimentError

ROOT = Path(__file__).resolve().parents[1]

HEAD = """
[experiment]
name = "t"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
baseline = "stock"
[variants.stock]
role = "stock"
"""


def _roles(write_toml, body: str) -> dict:
    exp = experiment.load(write_toml(HEAD + body))
    return {p.variant: (p.role, p.stack) for p in exp.points()}


def test_a_stack_gives_its_role_and_the_user_role_its_stack(write_toml):
    got = _roles(write_toml, """
[variants.liger]
stack = "liger"
[variants.user]
role = "user"
[variants.user-varlen]
role = "ablation"
stack = "user"
packing_backend = "varlen"
[variants.compiled]
role = "stock-compiled"
[variants.user-flex]
stack = "user"
packing_backend = "flex"
""")
    assert got == {"stock": ("stock", ""), "liger": ("peer", "liger"), "user": ("user", "user"),
                   "user-varlen": ("ablation", "user"), "compiled": ("stock-compiled", ""),
                   "user-flex": ("ours", "user")}  # enable(model, packing_backend="flex"): a setting of ours


@pytest.mark.parametrize("body, message", [
    ('role = "ours"\nstack = "liger"', "[variants.x.role] 'ours' cannot be built by stack 'liger', whose variants play peer"),
    ('role = "ours-default"\nstack = "liger"', "[variants.x.role] 'ours-default' cannot be built by stack 'liger'"),
    ('role = "peer"\nstack = "user"', "[variants.x.role] 'peer' cannot be built by stack 'user'"),
    ('role = "default"', "[variants.x.role] 'default' is not a valid choice (valid: stock, stock-compiled, peer, "
                         "unsloth, user, ours, reference, ablation)"),
    ('role = "user"\nstack = "unsloth"', "[variants.x.role] 'user' cannot be built by stack 'unsloth', whose variants "
                                          "play unsloth"),
    ('role = "user"\npacking_backend = "flex"', "[variants.x.role] 'user' is optim.enable(model) with its defaults; "
                                                "a variant that sets ['packing_backend'] is 'ours'"),
    ('role = "user"\ncuda_graph = true', "[variants.x.role] role 'user' runs as its stack: a user or peer stack "
                                         "runs the step eagerly"),  # the key the file has, not the implied stack
    ('stack = "liger"\ncuda_graph = true', "[variants.x.stack] a user or peer stack runs the step eagerly"),
    ('role = "user"\nstack = "user"\ncuda_graph = true', "[variants.x.stack] a user or peer stack runs the step"),
])
def test_a_role_the_variant_cannot_play_is_one_error(write_toml, body, message):
    with pytest.raises(ExperimentError) as e:
        experiment.load(write_toml(HEAD + "[variants.x]\n" + body + "\n"))
    assert message in str(e.value), str(e.value)


def test_a_kept_file_that_says_ours_default_reads_in_todays_vocabulary(write_toml):
    got = _roles(write_toml, """
[variants.enable]
role = "ours-default"
stack = "user"
[variants.defaults]
role = "ours-default"
moe_backend = "auto"
""")
    assert got["enable"] == ("user", "user") and got["defaults"] == ("ours", "")


def test_parts_read_from_the_role_and_the_baseline_only():
    def row(variant, role, **kw):
        return {"variant": variant, "baseline_variant": "stock", "role": role, **kw}
    assert roles.parts(row("stock", "stock")) == {"stock"}
    assert roles.parts(row("stock-graph", "stock")) == set()  # stock, but not the experiment's baseline
    assert roles.parts(row("liger", "peer", stack="liger")) == {"peer"}
    assert roles.parts(row("save_on_cpu", "peer")) == {"peer"}
    assert roles.parts(row("user", "user", stack="user")) == {"user", "best"}
    assert roles.parts(row("user", "ours-default", stack="user")) == {"user", "best"}  # an older row
    assert roles.parts(row("auto", "ours-default")) == {"best"}  # optim's defaults, not the user's build
    assert roles.parts(row("graph", "ours")) == {"best"}
    assert roles.parts(row("c", "stock-compiled")) == {"stock-compiled"}  # a peer of its own in every table
    assert roles.parts(row("a", "ablation")) == set()
    # recorded before the vocabulary had stock-compiled: stock, not the baseline, its layers compiled
    old = row("stock-flex-compiled", "stock", switches={"compile_layers": True})
    assert roles.role_of(old) == "stock-compiled" and roles.parts(old) == {"stock-compiled"}
    assert roles.parts(row("stock", "stock", switches={"compile_layers": True})) == {"stock"}  # the baseline stays


def test_frames_read_older_rows_in_todays_vocabulary():
    from harness.report import frames

    def row(variant, role, **kw):
        return {"kind": "step", "status": "ok", "variant": variant, "baseline_variant": "s", "role": role,
                "step_ms": {"p20": 1.0, "p50": 1.0, "p80": 1.0}, **kw}
    df = frames.steps_frame([row("s", "stock"), row("u", "ours-default", stack="user"), row("d", "ours-default")])
    assert dict(zip(df["variant"], df["role"])) == {"s": "stock", "u": "user", "d": "ours"}


def test_every_committed_experiment_and_row_reads_as_a_role():
    kept = sorted((ROOT / "results").glob("*/experiments/*.toml"))  # what the reports parse
    assert kept
    for path in [*sorted((ROOT / "experiments").glob("*.toml")), *kept]:
        if path.name == "blog.toml":
            continue
        exp = experiment.load(path)
        assert set(exp.roles.values()) <= set(roles.ROLES), path
        assert all(exp.roles.get(v) for v in exp.variants), f"{path}: a variant without a role"
    seen = set()
    for path in sorted((ROOT / "results").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            seen.add(roles.role_of(json.loads(line)))
    assert seen - {""} <= set(roles.ROLES) and {"stock", "peer", "user", "ours"} <= seen, seen


def test_only_a_stock_variant_whose_layers_were_compiled_reads_as_stock_compiled():
    def row(**sw):
        return {"variant": "stock-x", "baseline_variant": "stock", "role": "stock", "switches": sw}
    assert roles.role_of(row(compile_layers=True)) == "stock-compiled"
    assert roles.role_of(row(compile_layers="auto")) == roles.role_of(row()) == "stock"  # not compiled, or not said


def test_enable_with_its_defaults_may_be_replayed_as_cuda_graphs_as_a_variant_of_ours(write_toml):
    """optim.enable(model) with every default, the step captured: a variant of ours (the loop that
    captures gets it), never the user role, which is the eager loop."""
    exp = experiment.load(write_toml(HEAD + """
[variants.user-graph]
role = "ours"
stack = "user"
cuda_graph = true
[variants.user]
role = "user"
"""))
    got = {p.variant: (p.role, p.stack, p.cuda_graph) for p in exp.points()}
    assert got["user-graph"] == ("ours", "user", True) and got["user"] == ("user", "user", False), got
    user = {p.variant: p.switches for p in exp.points()}
    assert user["user-graph"] == user["user"], user  # the same call: no switch set
