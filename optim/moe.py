"""MoE experts: grouped routing, grouped_mm experts and split LoRA (gpt-oss, Qwen3-MoE).

    import optim.moe
    model = optim.moe.enable(model)                       # auto backend, split LoRA, router frozen
    model = optim.moe.enable(model, moe_backend="sorted", moe_lora="merged")

Backends (``moe_backend``, env ``OPTIM_MOE_BACKEND``) are registered in transformers' experts
interface as ``optim_<backend>`` and selected through ``config._experts_implementation``, so the
model code is untouched:

- ``loop``: per-expert ``torch.where`` (the published reference; E host syncs per layer);
- ``sorted``: stable argsort + one count per expert, contiguous slices (1 host sync per layer);
- ``grouped_mm``: the same grouping feeding ``grouped_mm`` with device offsets (no host sync);
- ``auto``: ``grouped_mm`` on CUDA SM90+ where the kernel exists, else ``sorted``; decided per
  call from the device of the activations.

Split LoRA (``moe_lora="split"``): peft's ``target_parameters`` LoRA on ``experts.gate_up_proj`` /
``experts.down_proj`` normally parametrizes the weight as W + s·B·A for all E experts on every
forward. In split mode the peft ``ParamWrapper`` modules stay in place (same parameters, same
state-dict keys, so ``save_pretrained``/``from_pretrained`` keep working) but, instead of
parametrizing, hand their factors to the experts forward, which adds s·(X·A_e)·B_e on the routed
rows only. ``moe_lora="merged"`` keeps peft's behaviour (our backends then read the parametrized
weight). The router's own weights are frozen unless ``moe_train_router=True``; a router the user
made trainable through peft (``modules_to_save``, an adapter on it) is left as peft set it.

``moe_compile`` (``auto`` = on CUDA): the grouped_mm layer runs as one ``torch.compile``'d pure
function (``_moe_compiled.grouped_pure``) shared by every layer; the gate, bias gathers and routing
weights fuse around the grouped GEMMs (the LoRA factors are cast and laid out eagerly first). A compiler failure logs one line and falls back
to the eager grouped path. ``moe_saved="lean"`` (off by default: it slows the backward more than a
step can spare where activations fit) has that compiled layer keep its input and the gate/up projection's output for backward, and recompute the
per-expert gather, the gate and the routing weights' product there: less than half the activation
memory per routed token, no GEMM recomputed (``_moe_compiled.grouped_pure``). Where that graph fails
to compile (in the forward), it logs one line and the partitioner's graph (``moe_saved="all"``)
runs instead, as it does, silently, for a batch whose routed rows (tokens × top-k) are not a
16-byte multiple of the dtype (``_moe_compiled.lean_fits``): those batches keep the default's memory.

Only torch, transformers and peft are imported here.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from optim import _moe_compiled as compiled
from optim import _moe_ops as ops
from optim._fallback import passes_through
from optim._hf import owner
from optim._syncs import is_sync_warning
from optim.switches import Switch, switches_of

try:  # peft is optional: without it there is simply no LoRA to split
    from peft.tuners.lora.layer import ParamWrapper
except ImportError:  # pragma: no cover
    ParamWrapper = None
try:  # what peft made of a router: a modules_to_save wrapper, an adapter layer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError:  # pragma: no cover
    BaseTunerLayer = AuxiliaryTrainingWrapper = None

SWITCHES: dict[str, Switch] = switches_of("optim.moe")

log = logging.getLogger("optim.moe")

IMPL_PREFIX = "optim_"
_LORA_ATTR = "_optim_moe_lora"  # per-call stash of split-LoRA factors on the experts module


# ---------------------------------------------------------------------------------------------
# Backends, registered in transformers' experts interface
# ---------------------------------------------------------------------------------------------


def auto_backend(device: torch.device | str) -> str:
    """The fastest backend we have for ``device``: grouped_mm needs no host sync and runs every
    expert in one kernel; it is tuned for Hopper (SM90) and later. Elsewhere sorted slices."""
    device = torch.device(device)
    if device.type == "cuda" and ops.grouped_mm_available(device):
        if torch.cuda.get_device_capability(device) >= (9, 0):
            return "grouped_mm"
    return "sorted"


def _compile_wanted(experts, hidden: torch.Tensor) -> bool:
    mode = getattr(experts.config, "_optim_moe_compile", "auto")
    if mode is False:
        return False
    return mode is True or hidden.device.type == "cuda"


def _make_impl(backend: str):
    def experts_forward(self, hidden_states, router_indices, routing_weights):
        name = auto_backend(hidden_states.device) if backend == "auto" else backend
        raw = getattr(self, _LORA_ATTR, None) or {}
        if name == "grouped_mm" and _compile_wanted(self, hidden_states):
            gate = compiled.gate_spec(self)
            dev, dtype = hidden_states.device, hidden_states.dtype
            lean = (getattr(self.config, "_optim_moe_saved_mode", SWITCHES["moe_saved"].default) == "lean"
                    and compiled.lean_fits(router_indices, dtype))
            lora_c = None
            # lean's graph first where asked; a failure of it falls back to the partitioner's graph,
            # and a failure of that one to the eager grouped path below
            for mode in ((True, False) if lean else (False,)):
                fn = compiled.compiled_grouped(dev, dtype, mode) if gate is not None else None
                if fn is None:
                    continue
                if lora_c is None:
                    lora_c = {proj: [(*compiled.compile_factors(wa, wb, self.num_experts, dtype), s)
                                     for wa, wb, s in factors] for proj, factors in raw.items()}
                try:
                    return fn(
                        hidden_states, router_indices, routing_weights,
                        ops.weight_of(self, "gate_up_proj"), getattr(self, "gate_up_proj_bias", None) if self.has_bias else None,
                        ops.weight_of(self, "down_proj"), getattr(self, "down_proj_bias", None) if self.has_bias else None,
                        lora_c.get("gate_up_proj", []), lora_c.get("down_proj", []), gate, self.num_experts, mode,
                    )
                except Exception as e:  # a compiler failure must not stop training
                    if passes_through(e):
                        raise
                    compiled.compile_failed(dev, dtype, e, mode)
        dtype = self.gate_up_proj.dtype
        lora = {proj: [(*ops.raw_to_factors(wa, wb, self.num_experts, dtype), s) for wa, wb, s in factors]
                for proj, factors in raw.items()}
        return ops.BACKENDS[name](self, hidden_states, router_indices, routing_weights, lora)

    experts_forward.__name__ = f"{IMPL_PREFIX}{backend}_experts_forward"
    return experts_forward


for _b in SWITCHES["moe_backend"].choices:
    ALL_EXPERTS_FUNCTIONS.register(IMPL_PREFIX + _b, _make_impl(_b))


def _has_layout(module: nn.Module) -> bool:
    # Modules decorated by transformers' @use_experts_implementation with a fused gate_up
    # projection: GptOssExperts, Qwen3MoeExperts (tested) and same-layout relatives.
    return (
        getattr(module, "has_gate", False)
        and hasattr(module, "is_transposed")
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and hasattr(module, "config")
    )


def _refusal(module: nn.Module) -> str | None:
    """What an experts module of that layout does that the backends here do not: a norm after each
    expert (transformers applies it before the routing weights), or experts sharded over ranks
    (expert parallel: ids past this rank's experts). None where nothing."""
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm)"
    if getattr(module, "_is_expert_parallel", False):
        return "experts sharded over ranks (expert parallel)"
    return None


def _is_experts(module: nn.Module) -> bool:
    return _has_layout(module) and _refusal(module) is None


def _uses_optim_backend(experts: nn.Module) -> bool:
    impl = getattr(experts.config, "_experts_implementation", None) or ""
    return impl.startswith(IMPL_PREFIX)


# ---------------------------------------------------------------------------------------------
# Split LoRA on peft's ParamWrapper
# ---------------------------------------------------------------------------------------------


def lora_factors(wrapper, adapter: str, dtype: torch.dtype | None = None):
    """``(A_t, B_t, scaling)`` of one peft expert LoRA, such that peft's per-expert delta on the
    (E, in, out) view of the weight is ``scaling * A_t[e] @ B_t[e]``.

    peft stores ``lora_A.weight`` as (E·r, in), expert-major, and ``lora_B.weight`` as
    (out, r·E), expert-minor (see ``ParamWrapper.get_delta_factors``). Both layouts reduce to the
    same X·A·B in the (E, in, out) view whether or not the stored weight is transposed.
    Both are new contiguous tensors (the size of the LoRA parameters, not of B·A), never views
    of peft's weights, and differentiable with respect to them. (The backends take A_t as a
    transposed view of the cast ``lora_A`` instead, which saves a copy each way.)
    """
    wa = wrapper.lora_A[adapter].weight
    a_t, b_t = ops.raw_to_factors(wa, wrapper.lora_B[adapter].weight, wrapper.num_experts, dtype or wa.dtype)
    return a_t.clone(memory_format=torch.contiguous_format), b_t, wrapper.scaling[adapter]


if ParamWrapper is not None:

    class SplitLoraParamWrapper(ParamWrapper):
        """peft's ParamWrapper with the same parameters, but whose forward passes the LoRA factors
        to the experts backend instead of parametrizing W + B·A for every expert."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            experts = self.get_base_layer()
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if (
                self.disable_adapters
                or self.merged
                or kwargs.get("adapter_names") is not None
                or not adapters
                or not _uses_optim_backend(experts)  # a stock backend would ignore the factors
            ):
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            stash = experts.__dict__.setdefault(_LORA_ATTR, {})
            # peft's own weights: the backend casts and lays them out as its path needs (the
            # compiled path also pads the rank for grouped_mm)
            stash[self.parameter_name] = [(self.lora_A[a].weight, self.lora_B[a].weight, self.scaling[a])
                                          for a in adapters]
            try:
                # base_layer may be the ParamWrapper of the other projection: it stashes its own
                return self.base_layer(x, *args, **kwargs)
            finally:
                stash.pop(self.parameter_name, None)


def _expert_wrappers(model: nn.Module):
    if ParamWrapper is None:
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, ParamWrapper)
        and m.parameter_name in ops.PROJECTIONS
        and _is_experts(m.get_base_layer())
    ]


def _routers(model: nn.Module):
    """The router beside each experts module: ``mlp.router`` (gpt-oss), ``mlp.gate`` (Qwen3-MoE)."""
    out = []
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if experts is None:
            continue
        base = experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
        if not _is_experts(base):
            continue
        for name in ("router", "gate"):
            r = getattr(m, name, None)
            if isinstance(r, nn.Module):
                out.append(r)
    return out


def _router_weights(router: nn.Module) -> list[nn.Parameter]:
    """The router's own weights, which ``moe_train_router`` freezes or trains. What peft made of a
    router is the user's choice and keeps the requires_grad peft gave it: a router in
    ``modules_to_save`` (peft trains its copy, and the original is out of the forward), and the
    adapter factors on a router peft tuned (its base weights follow the switch)."""
    if AuxiliaryTrainingWrapper is not None and isinstance(router, AuxiliaryTrainingWrapper):
        return []
    adapters = set()
    for m in router.modules():
        if BaseTunerLayer is not None and isinstance(m, BaseTunerLayer):
            for name in (*m.adapter_layer_names, *m.other_param_names):
                part = getattr(m, name, None)
                if isinstance(part, nn.Module):
                    adapters |= {id(p) for p in part.parameters()}
    return [p for p in router.parameters() if id(p) not in adapters]


# ---------------------------------------------------------------------------------------------
# enable
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeSettings:
    moe_backend: str
    moe_lora: str
    moe_compile: Any
    moe_train_router: bool
    moe_saved: str
    experts_layers: int
    lora_wrappers: int
    routers: int


def resolve(**settings: Any) -> dict[str, Any]:
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise TypeError(f"unknown optim.moe settings: {sorted(unknown)} (valid: {sorted(SWITCHES)})")
    return {name: sw.resolve(settings.get(name)) for name, sw in SWITCHES.items()}


def enable(model: nn.Module, **settings: Any) -> nn.Module:
    """Apply the MoE switches to a transformers model (peft-wrapped or not); returns ``model``.

    Call it before building the optimizer: it may change which parameters require grad.
    A model without MoE experts is returned unchanged.
    """
    cfg = resolve(**settings)
    experts = [m for m in model.modules() if _is_experts(m)]
    refused = {why for m in model.modules() if _has_layout(m) and (why := _refusal(m))}
    if refused:  # left to transformers' own experts, which do what these do
        log.warning("optim.moe: keeping transformers' experts where they have %s", " and ".join(sorted(refused)))
    if not experts:
        return model
    state = vars(owner(model))
    if _SAVED not in state:  # the model as it was before the first enable, for disable()
        state[_SAVED] = (
            [(c, getattr(c, "_experts_implementation", None)) for c in {id(m.config): m.config for m in experts}.values()],
            [(w, type(w)) for w in _expert_wrappers(model)],
            [(p, p.requires_grad) for r in _routers(model) for p in _router_weights(r)],
        )
    # Backend: transformers dispatches every experts forward through config._experts_implementation.
    for conf in {id(m.config): m.config for m in experts}.values():
        conf._experts_implementation = IMPL_PREFIX + cfg["moe_backend"]
        conf._optim_moe_compile = cfg["moe_compile"]
        conf._optim_moe_saved_mode = cfg["moe_saved"]
    # LoRA: swap the class of peft's expert ParamWrappers (parameters and state-dict keys unchanged).
    wrappers = _expert_wrappers(model)
    for w in wrappers:
        w.__class__ = SplitLoraParamWrapper if cfg["moe_lora"] == "split" else ParamWrapper
    routers = _routers(model)
    for r in routers:
        for p in _router_weights(r):
            p.requires_grad_(cfg["moe_train_router"])
    state["_optim_moe"] = MoeSettings(
        cfg["moe_backend"], cfg["moe_lora"], cfg["moe_compile"], cfg["moe_train_router"], cfg["moe_saved"],
        len(experts), len(wrappers), len(routers)
    )
    return model


_SAVED = "_optim_moe_saved"


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: the experts implementation, peft's expert LoRA wrappers and the routers'
    requires_grad as they were before the first enable."""
    saved = vars(owner(model)).pop(_SAVED, None)
    vars(owner(model)).pop("_optim_moe", None)
    if saved is None:
        return model
    configs, wrappers, router_params = saved
    for conf, impl in configs:
        conf._experts_implementation = impl
        vars(conf).pop("_optim_moe_compile", None)
        vars(conf).pop("_optim_moe_saved_mode", None)
    for w, cls in wrappers:
        w.__class__ = cls
    for p, requires_grad in router_params:
        p.requires_grad_(requires_grad)
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    """What enable() did, for result rows (empty when it was not applied)."""
    s = vars(owner(model)).get("_optim_moe")
    if s is None:
        return {}
    d = dict(s.__dict__)
    ex = next((m for m in model.modules() if _is_experts(m)), None)
    if ex is not None and s.moe_backend == "auto":
        d["moe_backend_resolved"] = auto_backend(next(ex.parameters()).device)
    if compiled.COMPILE_FAILED:
        d["moe_compile_errors"] = {"/".join(map(str, k)): v[:300] for k, v in compiled.COMPILE_FAILED.items()}
    return d


# ---------------------------------------------------------------------------------------------
# Host-sync counting
# ---------------------------------------------------------------------------------------------


@dataclass
class HostSyncs:
    counted: int = 0  # the explicit sync points in optim.moe's backends (any device)
    observed: int | None = None  # every CUDA sync in the region (torch sync debug mode); None on CPU


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str | None = None):
    """Count host syncs inside the block.

    ``counted`` is exact for our backends on every device. On CUDA ``observed`` also counts
    what the rest of the code in the block does (stock backends, peft, the model), from the
    warnings ``torch.cuda.set_sync_debug_mode("warn")`` emits for each synchronizing call.
    """
    res = HostSyncs()
    start = ops.SYNC_COUNTER.count
    cuda = device is not None and torch.device(device).type == "cuda"
    if not cuda:
        try:
            yield res
        finally:
            res.counted = ops.SYNC_COUNTER.count - start
        return
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield res
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            res.counted = ops.SYNC_COUNTER.count - start
            res.observed = sum(is_sync_warning(w) for w in caught)


__all__ = [
    "SWITCHES",
    "enable",
    "resolve",
    "describe",
    "auto_backend",
    "lora_factors",
    "count_host_syncs",
    "HostSyncs",
    "MoeSettings",
]
