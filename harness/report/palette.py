"""The roles a reader follows from plot to plot, and the colour each keeps in every figure: the
blog's and, where an experiment ran more variants than a plot can tell apart, its own report's."""

from __future__ import annotations

from harness.roles import PARTS as ROLES  # noqa: F401 (the parts a reader follows, in this order)
ROLE_LABEL = {"stock": "stock transformers + peft", "stock-compiled": "stock + torch.compile", "peer": "Liger-Kernel", "unsloth": "Unsloth",
              "user": "optim.enable() defaults", "best": "ours, best setting"}
ROLE_COLOR = {"stock": "#7f7f7f", "stock-compiled": "#ff7f0e", "peer": "#9467bd", "unsloth": "#8c564b", "user": "#1f77b4", "best": "#2ca02c"}
ROLE_MARKER = {"stock": "o", "stock-compiled": "v", "peer": "s", "unsloth": "P", "user": "^", "best": "D"}
