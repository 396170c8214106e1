"""Fine-tuning optimizations for Hugging Face models, each behind its own switch.

    import optim
    model = optim.enable(model)                    # every optimization on where it helps
    model = optim.enable(model, offload="double")  # or pick per switch (also OPTIM_<NAME> env vars)
    optim.disable(model)                           # back to stock, every module

- ``optim.packing``: packed-sequence metadata and attention structures built once per batch
  (switches ``packing_backend``, ``packing_cache``). Pass the batch's document lengths with
  ``packing=optim.packing.PackedMetadata.from_lengths(...)`` or use ``PackingCollator``.
- ``optim.norm``: the decoder stack's final RMSNorm in token chunks, keeping its input instead of
  an fp32 copy (``norm_chunk``); off by default until measured.
- ``optim.offload``: checkpointed layer inputs in pinned host memory, double-buffered reload
  (``offload``, ``offload_guard``, ``offload_profile``); off by default, since it trades time for memory.
- ``optim.moe``: grouped expert routing, grouped_mm and split LoRA on experts
  (``moe_backend``, ``moe_lora``, ``moe_compile``, ``moe_saved``, ``moe_train_router``); a dense model is left
  unchanged.
- ``optim.lora``: peft's LoRA Linear layers as one autograd function in the model's dtype, the
  layer's input saved once instead of an fp32 copy per projection (``lora``).
- ``optim.mlp``: SwiGLU MLPs in token chunks, keeping only their input for the backward
  (``mlp_chunk``); off by default, since it trades time for memory.
- ``optim.recompute``: checkpointed layers skip their recompute while their activations fit in
  the GPU memory the step leaves free (``recompute``); the math is plain checkpointing's.
- ``optim.loss``: lm_head + cross-entropy in token chunks with the gradient made in the forward,
  so ``model(..., labels=...)`` never holds the full fp32 logits (``fused_loss``).
- ``optim.regional``: each decoder layer through torch.compile, one graph shared by all layers
  (``compile_layers``); cuts the kernel launches of host-bound steps.
- ``optim.collector``: Python's cycle collector kept out of the step: its young threshold raised
  so a step's objects die before a collection walks them (``gc_threshold``, off by default);
  process-wide, only ever raised, put back when the last enabled model is disabled.
- ``optim.graphs``: not a model switch but a training-loop tool: ``GraphedStep`` captures a whole
  step (forward with the loss, backward, optimizer) as CUDA graphs and replays it, so a
  host-bound step runs at the GPU's pace.

``optim`` imports only torch, transformers and peft; it never imports the benchmark harness.
Each optimization is one module exposing ``SWITCHES``, ``enable(model, **settings)`` and
``disable(model)``; optionally ``describe(model)`` (what ``enabled`` reports) and
``run_stats(model)`` (what it did in the steps so far, which the harness records in each row).
"""

from __future__ import annotations

from optim._hf import DATA_PARALLEL as DATA_PARALLEL  # the error nn.DataParallel meets
from optim._hf import owner, refuse_data_parallel
from optim.switches import DECLARED, Switch

_ENABLED = "_optim_enabled"

__all__ = ["Switch", "SWITCHES", "MODULES", "disable", "enable", "enabled", "resolved"]

# The order ``enable`` applies them in; regional last: it compiles the layers as the others left them.
MODULES = ("optim.packing", "optim.moe", "optim.lora", "optim.mlp", "optim.norm", "optim.offload", "optim.recompute",
           "optim.loss", "optim.regional", "optim.collector")


def _modules():
    import importlib

    return {name.removeprefix("optim."): importlib.import_module(name) for name in MODULES}


def resolved(module, **settings) -> dict:
    """The value each of ``module``'s switches takes given ``settings``: the keyword, else its
    OPTIM_<NAME> environment variable, else its default."""
    return {name: sw.resolve(settings.get(name)) for name, sw in module.SWITCHES.items()}


def __getattr__(name):
    if name == "SWITCHES":
        return {k: v for mod in MODULES for k, v in DECLARED[mod].items()}
    raise AttributeError(name)


def enable(model, *, only=None, **settings):
    """Enable every optimization on a transformers model (peft-wrapped or not), each with its
    defaults unless ``settings`` (or an OPTIM_<NAME> environment variable) says otherwise.

    Call it after peft wraps the model and before the optimizer is built: the MoE router
    setting decides which parameters train.

    ``offload`` is off by default and leaves checkpointing alone; ``offload="none"`` named in a
    later call turns an earlier offload off. ``only`` (module names such as
    ``("packing", "regional")``) applies just those modules, each as asked: ``only=("offload",)``
    with ``offload="none"`` still routes checkpointing through the offloader. ``enabled(model)``
    says what the calls applied; ``disable(model)`` undoes them all.
    """
    import torch

    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        raise TypeError(f"optim.enable got a {type(model).__name__}: enable the model it wraps "
                        "(optim.enable(model.module), or before wrapping it), then wrap the enabled model")
    mods = _modules()
    known = {k for mod in mods.values() for k in mod.SWITCHES}
    unknown = set(settings) - known
    if unknown:
        raise ValueError(f"unknown optim switch(es) {sorted(unknown)} (valid: {', '.join(sorted(known))})")
    if only is not None:
        names = [n.removeprefix("optim.") for n in ([only] if isinstance(only, str) else only)]
        bad = sorted(set(names) - set(mods))
        if bad:
            raise ValueError(f"unknown optim module(s) {bad} (valid: {', '.join(mods)})")
        outside = sorted(k for k in settings if not any(k in mods[n].SWITCHES for n in names))
        if outside:
            raise ValueError(f"switch(es) {outside} belong to modules outside only={tuple(names)}")
        mods = {k: v for k, v in mods.items() if k in names}
    for mod in mods.values():  # every value checked (keywords and OPTIM_* alike) before the model changes
        resolved(mod, **{k: v for k, v in settings.items() if k in mod.SWITCHES})
    done = {}
    for name, mod in mods.items():
        own = {k: v for k, v in settings.items() if k in mod.SWITCHES}
        if only is None and name == "offload" and mod.SWITCHES["offload"].resolve(own.get("offload")) == "none":
            if "offload" in own:  # asked for by name: off, as it was before any enable
                mod.disable(model)
                done[name] = None
            continue  # off by default: enabling "none" would still turn checkpointing on
        mod.enable(model, **own)
        done[name] = {"settings": own, "resolved": resolved(mod, **own)}
    # merged with earlier calls: a module this call skipped (offload left at "none") still runs
    state = vars(owner(model))
    applied = {**state.get(_ENABLED, {}), **done}
    state[_ENABLED] = {n: applied[n] for n in _modules() if applied.get(n) is not None}
    refuse_data_parallel(owner(model), on=bool(state[_ENABLED]))  # one clear error at the first step
    return model


def enabled(model) -> dict:
    """Per module the ``enable`` calls applied (in ``MODULES`` order): what it runs now (the
    module's ``describe``, read at this call, so it counts the forwards so far, else the settings it
    got) and ``resolved``, the value each of its switches took when it was enabled."""
    mods = _modules()
    out = {}
    for name, applied in vars(owner(model)).get(_ENABLED, {}).items():
        describe = getattr(mods[name], "describe", None)
        out[f"optim.{name}"] = {**(describe(model) if describe else applied["settings"]),
                                "resolved": applied["resolved"]}
    return out


def disable(model):
    """Undo every ``enable`` on ``model``: stock attention, experts, loss and checkpointing, no
    compiled layers, every hook and wrapped method removed. Returns the model."""
    for name, mod in reversed(list(_modules().items())):
        mod.disable(model)
    vars(owner(model)).pop(_ENABLED, None)
    refuse_data_parallel(owner(model), on=False)
    return model
