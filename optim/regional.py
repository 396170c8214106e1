"""Regional compilation: every decoder layer runs as one torch.compile'd graph, shared by all.

A LoRA step of a small model on an H100 is host-bound. Eager PyTorch issues about a
hundred kernels per decoder layer: RMSNorm's casts and reductions, rotary embeddings, and peft's
LoRA matmuls, scalings and adds. Each launch costs tens of microseconds of host time, and the
GPU sits idle between them (Qwen3-0.6B takes about as long at 2048 tokens as at 8192). Inductor
fuses those elementwise chains, so a layer issues a few dozen kernels from one graph call.

What is compiled, and what is not:

- Every decoder layer (transformers' ``GradientCheckpointingLayer``), the way
  ``nn.Module.compile`` does it. Up to transformers 5.22 checkpointing wraps the layer call, so
  the recompute calls the same compiled code. From 5.23 it wraps ``forward``, inside the layer
  call; compiled whole, dynamo would meet the checkpoint as a higher-order op, and any graph break
  in the body (an eager attention path) makes it run the whole layer eager, more than twice as
  slow on Qwen3-8B. So a checkpointed layer runs its checkpoint eager
  and the body it wraps compiled, in the forward and in the recompute alike, whichever
  checkpoint function is set (torch's, ``optim.offload``'s). The layers share one code object,
  and dynamo treats their parameters as inputs, so one graph serves every layer: it compiles
  once, not L times.
- ``optim.packing``'s flex attention (cache on) is traced into the layer's graph: the batch's
  BlockMasks are built once before the layers run (``packing.prebuild_structures``) and enter
  the graph as inputs, so one graph serves every batch. Its other paths (SDPA mask, varlen, cache
  off) stay eager behind a graph break: the metadata cache is host state.
- A MoE block stays eager too. Its routing is data-dependent, and ``optim.moe`` compiles its
  experts itself (``moe_compile``).

A compiler failure logs one line, and that layer call and every later one run eager. OOM and
checkpoint's early stop of the recompute pass through. An error that eager raises as well (bad
input) is raised as eager raises it, and compilation stays on.

Switch ``compile_layers``: ``auto`` (the default: on for CUDA models), ``True``, ``False``.
``experiments/packing.toml`` sets stock flex_attention, the same with compiled layers, and packed
flex traced into them side by side (reports/packing).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optim._fallback import passes_through, recompile_limit
from optim._hf import owner
from optim.packing.routing import in_stock_mode
from optim.switches import Switch, switches_of

_LOG = logging.getLogger(__name__)

SWITCHES: dict[str, Switch] = switches_of("optim.regional")


@dataclass
class CompileState:
    """Per model: which layers are compiled and whether the compiler failed."""

    mode: Any
    layers: int = 0
    eager_blocks: int = 0
    prebuilt: bool = False
    failed: str | None = None
    calls: dict[str, int] = field(default_factory=lambda: {"compiled": 0, "eager": 0})


_ATTR = "_optim_regional"
_BODIES: dict[Any, Any] = {}  # a layer class's checkpointed forward -> its compiled version


def _checkpointed_body(layer: nn.Module):
    """The forward that transformers >= 5.23 checkpoints inside ``layer.forward`` (None before)."""
    fwd = type(layer).forward
    code = getattr(fwd, "__code__", None)
    return getattr(fwd, "__wrapped__", None) if code is not None and code.co_name == "forward_with_checkpointing" else None


class _LayerCall:
    """A layer's ``_compiled_call_impl``: the compiled call, or eager once the compiler failed.
    Where the layer checkpoints inside its forward (transformers >= 5.23) and checkpointing is on,
    the call runs eager and the checkpoint gets the compiled body instead of the eager one."""

    def __init__(self, layer: nn.Module, state: CompileState):
        self.eager = layer._call_impl
        self.compiled = torch.compile(layer._call_impl)
        self.state = state
        self.body = _checkpointed_body(layer)
        self.body_compiled = None
        if self.body is not None:  # one compiled function per layer class: one dynamo cache
            self.body_compiled = _BODIES.setdefault(self.body, torch.compile(self.body))

    def __call__(self, *args, **kwargs):
        layer = self.eager.__self__
        if in_stock_mode():  # generate / a KV cache: the stock attention, as stock runs it
            self.state.calls["eager"] += 1
            return self.eager(*args, **kwargs)
        if self.body is not None and layer.gradient_checkpointing and layer.training:
            ckpt = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = self._with_compiled_body(ckpt)
            try:
                return self.eager(*args, **kwargs)
            finally:
                layer._gradient_checkpointing_func = ckpt
        return self._run(self.compiled, self.eager, *args, **kwargs)

    def _with_compiled_body(self, ckpt):
        def checkpoint(fn, *args, **kwargs):
            if isinstance(fn, functools.partial) and fn.func is self.body:
                fn = functools.partial(self._body, *fn.args, **fn.keywords)
            return ckpt(fn, *args, **kwargs)
        return checkpoint

    def _body(self, *args, **kwargs):  # kept by the checkpoint: the recompute calls it again
        return self._run(self.body_compiled, self.body, *args, **kwargs)

    _body._optim_runs = "body"  # what it runs, compiled or not: optim._recomputing.module_of reads it

    def _run(self, compiled, eager, *args, **kwargs):
        state = self.state
        if state.failed is None:
            state.calls["compiled"] += 1  # counted before: checkpoint's early stop raises out
            try:
                # the limit the other compiled paths raise: train and eval, adapters on and off, a
                # second model and a new length each make an entry, past dynamo's 8 it runs eager
                with recompile_limit():
                    return compiled(*args, **kwargs)
            except Exception as e:  # a compiler failure must not stop training
                if passes_through(e):
                    raise
                out = eager(*args, **kwargs)  # bad input raises here, as it would eager
                state.calls["compiled"] -= 1
                state.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                _LOG.warning("optim.regional: torch.compile of the decoder layers failed, running "
                             "them eager from now on (%s)", state.failed)
                state.calls["eager"] += 1
                return out
        state.calls["eager"] += 1
        return eager(*args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _moe_block(layer: nn.Module) -> nn.Module | None:
    mlp = getattr(layer, "mlp", None)
    return mlp if mlp is not None and hasattr(mlp, "experts") else None


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def enable(model: nn.Module, *, compile_layers=None, **_ignored) -> nn.Module:
    """Compile every decoder layer of a transformers model (peft-wrapped or not).

    Call it after the other optimizations (``optim.enable`` does): it compiles the layers as
    they are then. ``compile_layers`` (or OPTIM_COMPILE_LAYERS): auto (on CUDA), True, False.
    Returns the model.
    """
    mode = SWITCHES["compile_layers"].resolve(compile_layers)
    on = mode is True or (mode == "auto" and _model_device(model).type == "cuda")
    disable(model)  # a second enable starts from the eager layers
    state = CompileState(mode=mode)
    vars(owner(model))[_ATTR] = state
    if not on:
        return model
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("regional.enable: found no decoder layers (transformers GradientCheckpointingLayer) "
                         "in the model")
    from optim import packing

    state.prebuilt = packing.prebuild_structures(model) > 0  # flex traced into the layer graph
    for layer in layers:
        block = _moe_block(layer)
        if block is not None and not getattr(block, "_optim_regional_eager", False):
            # an instance attribute, so the class (and models without this switch) are untouched
            block.forward = torch.compiler.disable(block.forward)
            block._optim_regional_eager = True
            state.eager_blocks += 1
        layer._compiled_call_impl = _LayerCall(layer, state)
        state.layers += 1
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: every layer and MoE block runs its own eager forward again."""
    if vars(owner(model)).pop(_ATTR, None) is None:
        return model
    from optim import packing

    packing.drop_prebuilt(model)  # packing's auto picks for eager layers again
    for layer in decoder_layers(model):
        if isinstance(getattr(layer, "_compiled_call_impl", None), _LayerCall):
            layer._compiled_call_impl = None
        block = _moe_block(layer)
        if block is not None and vars(block).pop("_optim_regional_eager", False):
            vars(block).pop("forward", None)
    return model


def run_stats(model: nn.Module) -> dict[str, Any]:
    """How the layer calls ran in the steps so far, for a results row (read after the run: a
    compiler failure shows at a call)."""
    return {"compile_stats": describe(model)}


def describe(model: nn.Module) -> dict[str, Any]:
    """What enable() did and how the layer calls ran, for result rows (empty when not applied)."""
    s = vars(owner(model)).get(_ATTR)
    if s is None:
        return {}
    d = {"compile_layers": s.mode, "compiled_layers": s.layers, "eager_moe_blocks": s.eager_blocks,
         "flex_traced": s.prebuilt,
         "layer_calls": dict(s.calls)}
    graphs = _graphs(model)
    if graphs is not None:
        d["graphs"] = graphs  # more than a few: something guards per layer or per batch
    if s.failed:
        d["compile_error"] = s.failed
    return d


def _graphs(model: nn.Module) -> int | None:
    """Compiled graphs cached for the layers' forward (dynamo's private debug API; None if absent)."""
    if not vars(owner(model))[_ATTR].layers:
        return None
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    codes = set().union(*(layer_codes(m) for m in decoder_layers(model)))
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def layer_codes(layer: nn.Module) -> set:
    """The code objects dynamo caches a layer's compiled graphs on: its forward and, where
    transformers checkpoints inside it, the body's own function. A decorator around the body (5.24's
    ``deprecate_kwarg``) is left out: its one code object is shared by every function it wraps,
    attention's forward included, so its cache entries are not this layer's alone."""
    codes = {type(layer).forward.__code__}
    body = _checkpointed_body(layer)
    if body is not None:
        codes.add(inspect.unwrap(body).__code__)
    return codes
