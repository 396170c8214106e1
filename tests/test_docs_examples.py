"""Every code example in README.md and docs/ works as written.

Python examples run verbatim, in order, one namespace per document, given the two names the text
says are the reader's own: ``checkpoint`` (a saved model with its tokenizer: a tiny Qwen3 here)
and ``train_dataset`` (tokenized examples). An example preceded by ``<!-- example: gpu -->`` needs
CUDA and runs in the GPU suite. TOML examples parse (an experiment file is validated by the
harness's own loader), YAML parses, and every ``python -m harness`` or ``nox -s`` command in a
bash example names a subcommand, options and session that exist.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
GPU_MARK = "<!-- example: gpu -->"


def examples(path: Path) -> list[tuple[str, str, int, bool]]:
    """(language, code, line of the opening fence, needs a GPU) for each fenced block."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        gpu = start > 0 and lines[start - 1].strip() == GPU_MARK
        out.append((lang, "\n".join(lines[start + 1:j]) + "\n", start + 1, gpu))
        i = j + 1
    return out


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


PY_DOCS = [p for p in DOCUMENTS if any(lang == "python" and not gpu for lang, _, _, gpu in examples(p))]


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """``checkpoint`` and ``train_dataset``, as the documents describe them."""
    from datasets import Dataset

    from harness.workload import models
    from harness.workload.trainers import documents, tokenizer

    spec = models.get("qwen3-0.6b-tiny")
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=None, gradient_checkpointing=False)
    model.config.use_cache = True
    model.generation_config.use_cache = True
    path = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(path)
    tokenizer(spec.vocab_size).save_pretrained(path)
    return {"checkpoint": str(path), "train_dataset": Dataset.from_list(documents(16, spec.vocab_size, 5, 40))}


def _run(path: Path, reader: dict, tmp_path, monkeypatch, *, gpu: bool) -> int:
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__", **reader}
    ran = 0
    for lang, code, line, needs_gpu in examples(path):
        if lang != "python" or (needs_gpu and not gpu):
            continue
        try:
            exec(compile(code, f"{_name(path)}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the example at {_name(path)}:{line} fails as written: "
                                 f"{type(e).__name__}: {e}") from e
        ran += 1
    return ran


@pytest.mark.parametrize("path", PY_DOCS, ids=_name)
def test_python_examples_run_as_written(path, reader, tmp_path, monkeypatch):
    assert _run(path, reader, tmp_path, monkeypatch, gpu=False) > 0


GPU_DOCS = [p for p in DOCUMENTS if any(lang == "python" and gpu for lang, _, _, gpu in examples(p))]


def _run_as_a_script(path: Path, reader: dict, tmp_path, *, gpu: bool) -> int:
    """``_run`` in a fresh interpreter with one GPU visible (the first this process sees), as a
    reader runs a document's examples as one script: a process that sees several GPUs (a shard
    that holds two for the distributed tests) makes Trainer and TRL choose ``nn.DataParallel``."""
    import os
    import pickle
    import subprocess
    import sys

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "reader.pkl").write_bytes(pickle.dumps(reader))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # unset: every GPU; "": none, and none it stays
    first = "0" if visible is None else visible.split(",")[0].strip()
    paths = [str(ROOT), str(ROOT / "tests"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=first, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    script = ("import pickle, sys\n"
              "from pathlib import Path\n"
              "import pytest\n"
              "import test_docs_examples as t\n"
              "here = Path(sys.argv[2])\n"
              "n = t._run(Path(sys.argv[1]), pickle.loads((here / 'reader.pkl').read_bytes()), here,\n"
              "           pytest.MonkeyPatch(), gpu=sys.argv[3] == 'gpu')\n"
              "print('EXAMPLES RAN', n)\n")
    run = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path), "gpu" if gpu else "cpu"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return int(run.stdout.split("EXAMPLES RAN")[-1])


def test_a_document_run_as_a_script_sees_one_gpu_runs_each_example_once_and_fails_where_one_fails(
        reader, tmp_path, monkeypatch):
    # the GPU suite's way of running a document, checked on CPU with the smallest one that has examples
    path = min(PY_DOCS, key=lambda p: len(p.read_text()))
    expected = sum(1 for lang, _, _, gpu in examples(path) if lang == "python" and not gpu)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 7")  # a shard that holds two GPUs
    seen = tmp_path / "seen.md"
    seen.write_text(path.read_text() + "\n```python\nimport os\n"
                    "assert os.environ['CUDA_VISIBLE_DEVICES'] == '5', os.environ['CUDA_VISIBLE_DEVICES']\n```\n")
    assert _run_as_a_script(seen, reader, tmp_path / "ok", gpu=False) == expected + 1
    broken = tmp_path / "broken.md"
    broken.write_text(path.read_text() + "\n```python\nraise RuntimeError('as written')\n```\n")
    with pytest.raises(AssertionError, match="fails as written: RuntimeError: as written"):
        _run_as_a_script(broken, reader, tmp_path / "broken", gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("path", GPU_DOCS, ids=_name)
def test_gpu_examples_run_as_written(path, reader, tmp_path):
    assert _run_as_a_script(path, reader, tmp_path, gpu=True) > 0


def _blocks(lang: str):
    return [(p, code, line) for p in DOCUMENTS for lg, code, line, _ in examples(p) if lg == lang]


@pytest.mark.parametrize("path,code,line", _blocks("toml"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_toml_examples_parse(path, code, line):
    raw = tomllib.loads(code)
    if "experiment" in raw:
        from harness.run.experiment import parse

        parse(raw, f"{_name(path)}:{line}")


@pytest.mark.parametrize("path,code,line", _blocks("yaml"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_yaml_examples_parse(path, code, line):
    import yaml

    assert yaml.safe_load(code)


def _sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any("session" in ast.unparse(d) for d in f.decorator_list)}


def _commands(code: str):
    for raw in code.splitlines():
        line = raw.split("  #")[0].strip()
        for part in line.split("&&"):
            words = shlex.split(part.strip())
            if words:
                yield words


@pytest.mark.parametrize("path,code,line", _blocks("bash"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_bash_examples_name_commands_that_exist(path, code, line):
    from harness.cli import build_parser

    parser, sessions = build_parser(), _sessions()
    for words in _commands(code):
        if words[:3] in (["python", "-m", "harness"], ["python3", "-m", "harness"]):
            try:
                parser.parse_args(words[3:])
            except SystemExit:
                raise AssertionError(f"{_name(path)}:{line}: `{' '.join(words)}` is not a valid harness command")
        if "nox" in words and "-s" in words:
            session = words[words.index("-s") + 1]
            assert session in sessions, f"{_name(path)}:{line}: no nox session {session!r}"
            rest = words[words.index("--") + 1:] if "--" in words else []
            if session == "gpu_tests" and rest:
                assert rest[0] in ("--shard", "--reverse", "--random-order", "-k", "-x"), rest
