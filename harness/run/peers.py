"""What a variant's model is built with, besides stock transformers + peft (its ``stack``).

- ``""`` (no ``stack`` key): the harness's own build, then ``optim.enable(model, only=...)`` with
  just the modules whose switches the variant sets; a variant that sets none is stock.
- ``"user"``: ``optim.enable(model)`` with no ``only``, every default as a user gets it; switches
  the variant sets are passed as that call's keywords.
- ``"liger"``: Liger-Kernel's patches for the model's family, applied to the bare model before
  peft wraps it (``_apply_liger_kernel_to_instance``, what ``Trainer(use_liger_kernel=True)``
  calls). Liger is an optional peer (``pip install '.[peers]'``); where it is not installed or
  cannot run, the point's row says ``skipped`` and why.
- ``"compiled"``: stock, with every decoder layer compiled in place (``layer.compile()``, the
  regional compilation PyTorch recommends for transformer blocks), after peft, as a user who compiles
  their model does; no optim. peft's adapters on MoE experts' fused weights stay eager inside the
  compiled layers (``eager_param_adapters`` says why). Its role is ``stock-compiled``.
- ``"unsloth"``: Unsloth's own loader, LoRA and checkpointing (``harness.run.unsloth_stack``); no
  optim. Its role is ``unsloth``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: the Unsloth stack imports this module before torch
    import torch


class PeerUnavailable(RuntimeError):
    """The peer a variant compares against cannot run here; its row is ``skipped``, not an error."""


def liger_patch(device: torch.device) -> Callable:
    """The function that applies Liger-Kernel to a bare transformers model, or PeerUnavailable."""
    if device.type != "cuda":
        raise PeerUnavailable(f"Liger-Kernel's Triton kernels need a CUDA GPU; this point runs on {device.type}")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as e:
        raise PeerUnavailable(f"Liger-Kernel is not installed ({e}); install the peers extra: "
                              "pip install '.[peers]'") from None

    def patch(model) -> None:
        liger_supports(model.config.model_type)
        _apply_liger_kernel_to_instance(model=model)

    return patch


def liger_supports(model_type: str) -> None:
    """PeerUnavailable where Liger-Kernel has no patches for ``model_type``: its own entry point
    (``Trainer(use_liger_kernel=True)``) then logs and runs the stock model, which is no peer."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise PeerUnavailable(f"Liger-Kernel has no patches for model type {model_type!r}")


def compile_layers(model) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``nn.Module.compile``: the layer
    call runs compiled, its parameters and hooks stay where they are); returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise PeerUnavailable(f"{type(model).__name__} has no transformers decoder layers to compile")
    for layer in layers:
        layer.compile()
    eager_param_adapters(model)
    return len(layers)


def eager_param_adapters(model) -> int:
    """Leave peft's ``target_parameters`` adapters (``ParamWrapper``, the LoRA on MoE experts' fused
    weights) to eager inside compiled layers; returns how many wrappers (one per adapted weight).

    Each call of such an adapter registers a parametrization on the experts and removes it after,
    and every registration makes a new ``Parametrized...`` class. Dynamo guards on that class, so
    it recompiles the adapter at every call until its recompile limit and then runs it eagerly:
    inside a checkpointed layer the forward and its recompute then run different code and save
    different tensors (``CheckpointError``, seen on gpt-oss-20b on the GPU). A user who compiles
    such a model has to do the same: the experts run eagerly, the rest of the layer compiled."""
    import types

    import torch
    from peft.tuners.lora.layer import ParamWrapper

    # one per adapted weight: an experts module with gate_up and down adapted holds two, nested
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    for m in wrappers:  # bound per instance, so a deep copy of the model binds its own module
        m.forward = types.MethodType(torch.compiler.disable(type(m).forward, recursive=True), m)
    return len(wrappers)


def enable(model, stack: str, settings: dict[str, dict]) -> dict:
    """Apply ``optim`` as the variant's stack says; ``settings`` is the variant's optim switches
    per module (``harness.variant_keys.optim_settings``). Returns ``optim.enabled(model)``."""
    import optim

    flat = {k: v for per_module in settings.values() for k, v in per_module.items()}
    if stack == "user":
        optim.enable(model, **flat)
    elif stack == "liger":
        return {}  # applied to the bare model in the build, before peft
    elif stack == "unsloth":
        return {}  # built by Unsloth (harness.run.unsloth_stack), no optim
    elif stack == "compiled":
        compile_layers(model)
        return {}
    elif settings:
        optim.enable(model, only=tuple(settings), **flat)
    else:
        return {}
    return optim.enabled(model)
