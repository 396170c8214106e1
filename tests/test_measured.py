"""The registry of measured optimizations (harness.measured): a toy optimization with its own bench
rows, report section and blog part, added by its own files plus one registry line, is checked in
experiment files, stored, reported and blogged like the built-in ones."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness import measured, results
from harness.report import build_report
from harness.report.blog import build_blog
from harness.run import experiment
from harness.run.fields import ExperimentError

EXPERIMENT = """
[experiment]
name = "toyexp"
models = ["qwen3-0.6b-tiny"]
seq_lens = [64]
device = "cpu"
dtype = "fp32"
baseline = "plain"

[variants.plain]
[variants.toy-on]
packing_cache = false

[report.toy]
base = "plain"
min_gain_pct = {target}
"""

REPORT = '''
from harness.report import fmt


def _ms(rows, mode):
    return next((r["ms"] for r in rows if r.get("kind") == "toy_bench" and r.get("mode") == mode), None)


def bench_tables(rows, spec):
    on, off = _ms(rows, "on"), _ms(rows, "off")
    return "" if on is None else "#### Toy\\n\\n" + fmt.table(["mode", "ms"], [["off", fmt.ms(off)], ["on", fmt.ms(on)]])


def bench_targets(rows, spec):
    gain = fmt.gain_pct(_ms(rows, "off"), _ms(rows, "on"))
    want = spec["min_gain_pct"]
    return fmt.table(["target", "measured", "met?"],
                     [[f"toy gain >= {want}% (base {spec['base']})", fmt.signed_pct(gain), fmt.met(gain >= want)]])
'''

BLOG = '''
from harness.report.blog.common import Headline


def part(rows, spec, ctx):
    head = Headline("Toy", "nothing at all")
    ms = sorted(r["ms"] for r in rows if r.get("kind") == "toy_bench")
    if not ms:
        return "", head
    return f"## Toy\\n\\nThe toy ran {len(ms)} modes, fastest {ms[0]:.2f} ms (figures in {ctx.fig_dir.name}/).", head
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's own files, and its one registry line."""
    pkg = tmp_path / "toyopt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "report.py").write_text(REPORT)
    (pkg / "blog.py").write_text(BLOG)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(measured.REGISTRY, "toy", measured.Measured(
        "toy", variant_keys=("base",), target_keys=("min_gain_pct",), bench_kinds=("toy_bench",),
        report="toyopt.report", blog="toyopt.blog"))
    return tmp_path


def _file(tmp_path, target="10", **extra) -> experiment.Experiment:
    path = tmp_path / "toyexp.toml"
    text = EXPERIMENT.format(target=target) + "".join(f"{k} = {v}\n" for k, v in extra.items())
    path.write_text(textwrap.dedent(text))
    return experiment.load(path)


def test_its_report_table_is_checked_in_experiment_files(toy):
    assert _file(toy).report == {"toy": {"base": "plain", "min_gain_pct": 10}}
    with pytest.raises(ExperimentError, match=r"\[report.toy.bogus\] unknown key"):
        _file(toy, bogus="1")
    text = EXPERIMENT.format(target="10").replace('base = "plain"', 'base = "nope"')
    (toy / "bad.toml").write_text(text)
    with pytest.raises(ExperimentError, match=r"\[report.toy.base\] 'nope' is not a valid choice"):
        experiment.load(toy / "bad.toml")


def test_its_bench_rows_report_and_blog_part_appear(toy):
    root, reports = toy / "results", toy / "reports"
    rows = [{"kind": "toy_bench", "model": "qwen3-0.6b-tiny", "mode": "off", "ms": 2.0},
            {"kind": "toy_bench", "model": "qwen3-0.6b-tiny", "mode": "on", "ms": 1.25}]
    results.write_bench_rows(root, "toyexp", rows, env={"device_name": "cpu"}, command="python -m toyopt.bench")
    with pytest.raises(ValueError, match="not a microbenchmark row kind: 'toy_other'"):
        results.write_bench_rows(root, "toyexp", [{"kind": "toy_other"}], env={}, command="")
    kept = root / "toyexp" / "experiments"
    kept.mkdir()
    (kept / "0123456789abcdef.toml").write_text(Path(_file(toy).path).read_text())

    readme = build_report(root, "toyexp", reports).read_text()
    assert "#### Toy\n\n| mode | ms |\n|---|---|\n| off | 2.00 |\n| on | 1.25 |" in readme
    assert "| toy gain >= 10% (base plain) | +60.0% | yes |" in readme  # 2.0 / 1.25 - 1

    plan = toy / "blog.toml"
    plan.write_text('[blog]\ntitle = "Toy"\n\n[blog.sources]\ntoy = "toyexp"\n')
    blog = build_blog(root, reports, plan).read_text()
    assert "## Toy\n\nThe toy ran 2 modes, fastest 1.25 ms (figures in figures/)." in blog
    assert "| Toy | nothing at all |" in blog  # its line of the TL;DR


def test_the_built_in_entries_own_their_report_parts():
    for entry in measured.REGISTRY.values():
        parts = [p for p in ("lead", "sweep_targets", "bench_tables", "bench_targets") if entry.hook(p)]
        assert parts, f"{entry.name}: a registry entry with no report part"
        assert not entry.bench_kinds or entry.hook("bench_tables"), f"{entry.name}: bench rows no table reads"
    assert measured.bench_kinds() >= {"offload", "packing_m", "moe_routing", "loss_kernel", "trainer"}
