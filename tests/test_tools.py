"""The measuring tools under tools/ start, and refuse where they cannot measure."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", ["user_loop.py", "check_cost.py"])
def test_help_names_every_option(tool):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("usage:") and "--seq-len" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_check_cost_says_it_needs_a_gpu():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "check_cost.py")], capture_output=True, text=True)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr and p.stdout == ""

