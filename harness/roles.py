"""What a variant stands for in a comparison: one vocabulary, declared in the experiment file,
recorded in each row, and read through this module wherever a role matters (the report, its plots,
the blog, reproduce).

Roles (an experiment file's ``role``; a row's ``role``):

- ``stock``: transformers + peft as shipped; the experiment's ``baseline`` is one of these.
- ``stock-compiled``: the same with ``torch.compile``, as a user who compiles would run it
  (``stack = "compiled"``: every decoder layer compiled).
- ``peer``: another tool a user would pick instead: one a stack builds (``stack = "liger"``:
  Liger-Kernel), or one the harness sets by a switch (PyTorch's ``save_on_cpu``).
- ``unsloth``: Unsloth, the system the project's design comes from, built as its documentation
  builds a model (``stack = "unsloth"``: its loader, LoRA and checkpointing).
- ``user``: ``optim.enable(model)`` with its defaults, as a user calls it (``stack = "user"``,
  which this role implies).
- ``ours``: a setting of optim beyond its defaults, or the defaults run beyond the user's eager loop
  (``stack = "user"`` with ``cuda_graph = true``: the step replayed as CUDA graphs).
- ``reference``: the numerics or speed reference a comparison starts from.
- ``ablation``: a step between them, kept to show what each part buys.

A variant built by a stack has the stack's role unless the file says otherwise: ``stack = "liger"``
is the ``peer`` and plays nothing else, ``stack = "compiled"`` is ``stock-compiled``, ``stack = "unsloth"``
is ``unsloth``; ``stack = "user"`` is the ``user`` where it sets no optim
switch, and ``ours`` or an ``ablation`` where it does (``optim.enable(model, **switches)``).

The parts a reader follows from table to table and plot to plot (``PARTS``) are read from the
roles: the stock baseline, stock compiled, the peer, Unsloth, the user's path, and ours at its best
(the fastest of the ``user`` and ``ours`` variants). The first four (``PEERS``) are what a user would
run instead; a headline ratio is against the fastest of them measured at the point. Rows (and kept experiment files) from before the vocabulary was
one say ``ours-default`` for optim's defaults; ``role_of`` reads that as ``user`` where the user's
stack built the variant, else as ``ours``. Those from before ``stock-compiled`` say ``stock`` for a
stock variant other than the baseline whose decoder layers were compiled; ``role_of`` reads that as
``stock-compiled``.

This module imports nothing: an experiment file is checked against it without torch or pandas.
"""

from __future__ import annotations

from typing import Any, Mapping

ROLES = ("stock", "stock-compiled", "peer", "unsloth", "user", "ours", "reference", "ablation")
STACK_ROLE = {"user": "user", "liger": "peer", "compiled": "stock-compiled",  # a stack's role where none is named
              "unsloth": "unsloth"}
STACK_ROLES = {"user": ("user", "ours", "ablation"), "liger": ("peer",),  # the roles a stack's variant may play
               "compiled": ("stock-compiled",), "unsloth": ("unsloth",)}
LEGACY = ("ours-default",)  # a role name of rows recorded before the vocabulary was one (see role_of)

PARTS = ("stock", "stock-compiled", "peer", "unsloth", "user", "best")
PEERS = ("stock", "stock-compiled", "peer", "unsloth")  # what a user would run instead: a ratio's denominator is the fastest
OURS = ("user", "ours")  # the roles "best" picks from
SIDE_BY_SIDE = ("stock", "peer", "user")  # what a reader compares: from one run where one has all three


def role_of(r: Mapping[str, Any]) -> str:
    """The role a row, a point's fields or a variant plays ("" where none was declared)."""
    role = str(r.get("role") or "")
    if role == "ours-default":  # optim's defaults: the user's path where a user's stack built it
        return "user" if r.get("stack") == "user" else "ours"
    if role == "stock" and r.get("variant") != r.get("baseline_variant") \
            and (r.get("switches") or {}).get("compile_layers") is True and r.get("stack") in (None, "", "transformers"):
        return "stock-compiled"  # recorded before the vocabulary had it: stock with its layers compiled
    return role


def is_ours(r: Mapping[str, Any]) -> bool:
    """A variant of ours: the user's path or a setting beyond it (ablations and references are not)."""
    return role_of(r) in OURS


def is_baseline(r: Mapping[str, Any]) -> bool:
    """The experiment's stock baseline variant."""
    return role_of(r) == "stock" and r.get("variant") == r.get("baseline_variant")


def parts(r: Mapping[str, Any]) -> set[str]:
    """The parts (``PARTS``) a row, or a point's fields, may play."""
    role = role_of(r)
    out = set()
    if is_baseline(r):
        out.add("stock")
    if role in ("peer", "stock-compiled", "unsloth"):
        out.add(role)
    if role == "user":
        out.add("user")
    if role in OURS:
        out.add("best")
    return out
