import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (to catch tests that depend on order)")


def pytest_collection_modifyitems(config, items):
    import torch

    if config.getoption("--reverse"):
        items.reverse()
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `nox -s gpu_tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def write_toml(tmp_path):
    def _write(text: str, name: str = "exp.toml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write
