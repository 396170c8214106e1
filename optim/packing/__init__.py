"""Packed-sequence attention: boundary metadata built once per batch, reused by every layer.

When short documents are packed into one row, every layer needs the same boundary information
(lengths, ``cu_seqlens``, ``max_seqlen`` and the attention structure derived from them). Stock
transformers rebuilds it per forward (SDPA: a dense T×T mask; flash: ``cu_seqlens`` from
position_ids with a ``.item()`` sync in every layer) and gpt-oss never detects packing at all.
Here it is built once per batch and per device, cached, and reused by every layer call and
every gradient-checkpoint recompute.

Use::

    import optim.packing as packing
    model = packing.enable(model)                  # backend "auto", cache on
    batch = packing.PackingCollator(max_length=8192)(examples)
    out = model(**batch, use_cache=False)          # batch carries packing=PackedMetadata

or, with your own tensors, ``model(input_ids=..., position_ids=..., labels=...,
**packing.packed_kwargs(PackedMetadata.from_lengths(lengths)))``. With only ``position_ids``
(no metadata) the boundaries are read from them with exactly one device-to-host sync per batch.

Backends (switch ``packing_backend``):
  * ``sdpa``: ``scaled_dot_product_attention`` with a cached additive block-diagonal causal mask
    (built vectorized, O(T²) memory — the published path);
  * ``flex``: ``flex_attention`` with a cached document ``BlockMask`` built directly at block
    granularity (never a T×T tensor);
  * ``varlen``: FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``) on
    ``cu_seqlens``/``max_seqlen`` (CUDA, fp16/bf16 only).

``auto`` runs a batch whose rows are one document each (nothing to keep apart, as in long-context
training) with plain causal SDPA, in eager and compiled layers alike, on models without attention
sinks or sliding windows and where flash serves it (``backends.causal_applies``); other batches
get the table in ``backends``. With switch ``attention_split`` on (``backends.split_applies``), such
rows run FlashAttention varlen instead, and varlen's backward runs one group of query heads at a
time (``backends._split_backward``).

What runs where (``routing``): calls without a KV cache run the packed attention, a padded
``attention_mask`` turned into documents (each row's real tokens one, each run of padding another);
calls with a KV cache, ``generate()`` and masks of another form run the implementation ``enable``
replaced. ``disable`` (or ``packing_backend="off"``) restores the model as it was.

Layout: ``metadata`` (the batch's boundaries and their per-device cache), ``structures`` (the
SDPA mask, flex BlockMask and varlen arguments built from them), ``backends`` (the three kernels), ``collator`` (``PackingCollator``), ``routing`` (which
attention each forward runs), ``checks`` (the caller's position_ids against their metadata, on the
device); this module holds the switches, the attention function transformers
calls, ``enable`` and ``disable``.

Cache policy (switch ``packing_cache``):
  * one entry per device; it belongs to one batch and a new batch replaces it;
  * the batch is identified by the ``PackedMetadata`` object (immutable: lengths are tuples),
    or, without one, by the ``position_ids`` tensor object *and* its ``_version`` counter, so an
    in-place edit of position_ids makes the next layer rebuild instead of reading a stale mask;
  * the entry is dropped when the backward pass leaves the first attention layer of the batch
    (an identity autograd node on its query), so no T×T mask outlives the step; in no-grad use
    it lives until the next batch or :func:`release`.
  With the cache off everything is rebuilt in every layer call and every recompute.

gpt-oss attention sinks are applied exactly on every backend (see each path), and sliding-window
layers (``module.sliding_window``/``config.layer_types``) get their own cached structure.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass
from typing import Iterable

import torch

from optim.packing.backends import (
    KERNELS,
    AUTO_ON_CUDA,
    FusedFlexUnavailable,
    flex_core,
    flex_output,
    causal_applies,
    fused_flex_failure,
    one_document_per_row,
    resolve_backend,
    sdpa_causal,
    split_applies,
    varlen_available,
)
from optim.packing import routing
from optim.packing.collator import PackingCollator
from optim.packing.metadata import (
    ATTN_NAME,
    BACKENDS,
    COUNTERS,
    FLEX_BLOCK,
    FORWARD_KWARG,
    KERNEL_CALLS,
    STRUCTURES_KWARG,
    PackedMetadata,
    ReleaseOnBackward,
    build_entry,
    cached_entry,
    entry_for,
    counters,
    kernels,
    packed_kwargs,
    release,
    reset_counters,
)
from optim.packing.checks import raise_pending
from optim.packing.structures import build_flex_block_mask, build_sdpa_mask, build_varlen_args, cached_structure
from optim.packing.routing import in_stock_mode
from optim.switches import Switch, switches_of

SWITCHES: dict[str, Switch] = switches_of("optim.packing")


@dataclass(frozen=True)
class PackingSettings:
    cache: bool = True
    backend: str = "auto"
    validate: bool = True  # check the caller's position_ids against their metadata (``checks``)
    split: bool = False  # attention_split: flash varlen's backward a group of heads at a time (``backends``)
    compiled: bool = False  # optim.regional compiles the layers (prebuild_structures): auto picks for that
    stock: str | None = None  # the attention implementation enable() replaced: runs with a KV cache


_DEFAULT = PackingSettings()
# transformers' own implementations, each slower on packed rows than optim's (a T×T mask or
# boundaries re-read from position_ids in every layer); enable() replaces these and keeps any
# other (a user's registered function, a kernels-hub kernel).
STOCK_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
log = logging.getLogger("optim.packing")


def _layer_window(module, sliding_window) -> int | None:
    if sliding_window:
        return int(sliding_window)
    w = getattr(module, "sliding_window", None)
    if w:
        return int(w)
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is not None and idx is not None and types[idx] == "sliding_attention":
        return int(config.sliding_window)
    return None


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    packing: PackedMetadata | None = None,
    packing_structures: dict | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, H, T, D) q/k/v in, (B, T, H, D) out.

    Inside a compiled layer (``optim.regional``) with the batch's flex BlockMasks prebuilt
    outside the graph (``prebuild_structures``), flex attention is traced into the layer's
    graph. Everything else runs eager, behind a graph break: the metadata cache is host state.
    """
    if packing_structures is not None and torch.compiler.is_compiling() and not dropout \
            and key.shape[2] == query.shape[2]:
        # the window recorded by enable(), not _layer_window: that reads layer_idx, and a graph
        # guarded on layer_idx would be compiled once per layer
        window = int(sliding_window) if sliding_window else getattr(module, "_optim_packing_window", None)
        sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
        # the hook marks whole rows; the layer's own settings may since name a backend (kept as named)
        settings = getattr(module, "_optim_packing", _DEFAULT)
        if packing_structures.get(CAUSAL) and window is None and sinks is None and settings.backend == "auto" \
                and not split_applies(settings.split, query.device, query.dtype):
            return sdpa_causal(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None
        block_mask = packing_structures.get(window)
        if block_mask is not None:
            from torch.nn.attention.flex_attention import flex_attention

            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            gqa = query.shape[1] != key.shape[1]
            out, lse = flex_core(flex_attention, query, key, value, block_mask, scale, gqa, sinks is not None)
            return flex_output(out, lse, sinks, query.dtype), None
    return _packed_attention_eager(module, query, key, value, attention_mask, scaling, dropout,
                                   sliding_window, s_aux, position_ids, packing, **kwargs)


@torch.compiler.disable
def _packed_attention_eager(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                            s_aux, position_ids, packing, **kwargs):
    settings: PackingSettings = getattr(module, "_optim_packing", _DEFAULT)
    B, H, T, D = query.shape
    if key.shape[2] != T or attention_mask is not None:
        # keys from a KV cache, or a mask transformers built for the stock attention: a call the
        # model's forward ran as stock (routing), met again in a checkpoint's recompute
        stock = _stock_function(module, settings.stock)
        return stock(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     sliding_window=sliding_window, s_aux=s_aux, position_ids=position_ids, **kwargs)
    if dropout:
        raise NotImplementedError("packed attention does not implement attention dropout")
    scale = scaling if scaling is not None else D ** -0.5
    window = _layer_window(module, sliding_window)
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    device = query.device
    validate = settings.validate
    entry = entry_for(packing, position_ids, B, T, device, settings.cache, validate,
                       kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"))
    grad = torch.is_grad_enabled() and query.requires_grad
    layer = getattr(module, "layer_idx", None)
    if entry.first_module is None:
        # The batch's first attention call owns the entry, with or without grad: where the forward
        # runs under no_grad (optim.offload's), the owner's recompute, the step's last backward,
        # releases it, so every other layer's recompute still finds it.
        entry.first_module, entry.first_layer, entry.owner_grad = id(module), layer, grad
    elif grad and not entry.owner_grad and entry.first_module != id(module) and layer == entry.first_layer:
        # owned under no_grad by another model's first layer (a reference model run on the same batch):
        # the first layer of the model that trains takes it over
        entry.first_module, entry.owner_grad = id(module), True
    if settings.cache and grad and entry.first_module == id(module):
        query = ReleaseOnBackward.apply(query, entry.key, device)
    split = split_applies(settings.split, device, query.dtype)
    if settings.backend == "auto" and sinks is None and (window is None or window >= T) \
            and causal_applies(device, query.dtype, D) and one_document_per_row(entry):
        if split:  # the same causal attention, through the kernel whose backward splits
            return KERNELS["varlen"](entry, query, key, value, scale, None, None, settings.cache, split=True), None
        KERNEL_CALLS["sdpa-causal"] += 1
        return sdpa_causal(query, key, value, scale), None
    backend = resolve_backend(settings.backend, device, query.dtype, compiled=settings.compiled)
    if backend == "varlen" and split:
        return KERNELS["varlen"](entry, query, key, value, scale, window, sinks, settings.cache, split=True), None
    out = KERNELS[backend](entry, query, key, value, scale, window, sinks, settings.cache)
    return out, None


def _stock_function(module, name: str | None):
    """The attention function of implementation ``name`` (the one enable() replaced); eager is
    each model's own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager", ATTN_NAME):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(f"optim.packing: no eager attention found for {type(module).__name__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


_registered = False


def register() -> None:
    """Register ``packed_attention_forward`` under ``ATTN_NAME`` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, packed_attention_forward)
        _registered = True


def _prebuild_hook(module, args, kwargs):
    """Forward pre-hook of a decoder stack under compiled layers: the batch's flex BlockMasks, or,
    under ``auto`` for a batch of one document per row on a model with neither sinks nor sliding
    windows, the mark that has the layers run causal SDPA in their graph (no mask to build)."""
    settings, windows, plain, head_dim = vars(module)[_PREBUILT]
    meta, cu, max_len = kwargs.get(FORWARD_KWARG), kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if (meta is None and (cu is None or max_len is None)) or kwargs.get(STRUCTURES_KWARG) is not None \
            or in_stock_mode():
        return None
    ref = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None),
               args[0] if args else None)
    param = next(module.parameters(), None)
    if ref is None or param is None:
        return None
    device, pos = ref.device, kwargs.get("position_ids")
    flex = resolve_backend(settings.backend, device, param.dtype, compiled=settings.compiled) == "flex"
    causal_ok = plain and settings.backend == "auto" and causal_applies(device, param.dtype, head_dim)
    if not (flex or causal_ok):
        return None
    B, T = (meta.batch_size, meta.seq_len) if meta is not None else tuple(ref.shape[:2])
    entry = entry_for(meta, pos, B, T, device, True, settings.validate, cu, max_len)
    if causal_ok and one_document_per_row(entry):
        COUNTERS["causal_batches"] += 1
        return args, {**kwargs, STRUCTURES_KWARG: {CAUSAL: True}}
    if not flex:
        return None
    COUNTERS["flex_batches"] += 1
    masks = {w: cached_structure(entry, ("flex", w), functools.partial(build_flex_block_mask, entry, w), True)
             for w in windows}
    return args, {**kwargs, STRUCTURES_KWARG: masks}


_PREBUILT = "_optim_packing_prebuild"
CAUSAL = "causal"  # the key of packing_structures that marks a batch of one document per row


def prebuild_structures(model) -> int:
    """Build each packed batch's flex BlockMasks once, before the decoder layers run, and hand
    them to every layer as the ``packing_structures`` kwarg; returns the stacks hooked.

    For compiled layers (``optim.regional`` calls this): the masks enter the graph as inputs, so
    flex attention is traced into the layer and one graph serves every batch. Only with the
    cache on and the flex backend; other backends keep their graph break. Idempotent;
    ``drop_prebuilt`` undoes it.
    """
    settings = settings_of(model)
    if settings is None:
        return 0
    settings = dataclasses.replace(settings, compiled=True)  # auto now picks for compiled layers
    _set_settings(model, settings)
    if not settings.cache or settings.backend in ("off", "sdpa", "varlen"):
        return 0
    windows = tuple(sorted({_layer_window(m, None) for m in _attention_modules(model)},
                           key=lambda w: -1 if w is None else w))
    # causal SDPA serves a batch of whole-row documents only where no layer has sinks or a window
    attention = list(_attention_modules(model))
    plain = windows == (None,) and all(getattr(m, "sinks", None) is None for m in attention)
    head_dim = max((int(getattr(m, "head_dim", 0) or 0) for m in attention), default=0)
    n = 0
    for m in routing.decoder_stacks(model):
        if _PREBUILT not in vars(m):
            m.register_forward_pre_hook(_prebuild_hook, with_kwargs=True)
        vars(m)[_PREBUILT] = (settings, windows, plain, head_dim)
        n += 1
    return n


def drop_prebuilt(model) -> None:
    """Undo ``prebuild_structures``: no prebuilt masks, and ``auto`` picks for eager layers again."""
    for m in model.modules():
        if vars(m).pop(_PREBUILT, None) is None:
            continue
        routing.remove_pre_hook(m, _prebuild_hook)
    settings = settings_of(model)
    if settings is not None and settings.compiled:
        _set_settings(model, dataclasses.replace(settings, compiled=False))


def _attention_modules(model) -> Iterable[torch.nn.Module]:
    for m in model.modules():
        if hasattr(m, "q_proj") and hasattr(m, "layer_idx"):
            yield m


# Model types whose stock attention does not keep packed documents apart: transformers builds their
# masks without position_ids (tests/test_optim_enable.py says when that changes).
STOCK_MIXES_DOCUMENTS = {"gpt_oss": "transformers 5.17 to 5.24 (the newest tested) build gpt-oss's masks without position_ids"}


def enable(model, *, packing_cache=None, packing_backend=None, validate=None, attention_split=None, **_ignored):
    """Enable packed attention on a transformers causal LM (peft-wrapped or not).

    Registers the attention function, switches the model's attention implementation to it (so
    transformers also stops building its own masks), records the settings on every attention
    module and routes each forward (``routing``): calls with a KV cache, and ``generate``, run the
    implementation it replaced. Settings: ``packing_cache`` (True/False), ``packing_backend``
    (auto/sdpa/flex/varlen, or off: the model's own attention, undoing an earlier enable),
    ``validate`` (True/False: ``checks``) and ``attention_split`` (True/False: ``backends``), each
    also from OPTIM_PACKING_CACHE / OPTIM_PACKING_BACKEND / OPTIM_VALIDATE / OPTIM_ATTENTION_SPLIT.
    Other optim switches are ignored.
    Returns the model.
    """
    settings = PackingSettings(
        cache=SWITCHES["packing_cache"].resolve(packing_cache),
        backend=SWITCHES["packing_backend"].resolve(packing_backend),
        validate=SWITCHES["validate"].resolve(validate),
        split=SWITCHES["attention_split"].resolve(attention_split),
    )
    if settings.backend == "off":
        disable(model)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type in STOCK_MIXES_DOCUMENTS:
            log.warning("optim.packing: packing_backend='off' keeps stock %s attention, in which a packed "
                        "row's documents attend to each other (%s); feed it one document per row, or "
                        "leave packing on", model_type, STOCK_MIXES_DOCUMENTS[model_type])
        return model
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current not in (None, ATTN_NAME, *STOCK_ATTENTION):
        log.warning("optim.packing: kept your attention implementation %r (not one optim can judge); "
                    "packed attention is off for this model", current)
        return model
    previous = settings_of(model)
    stock = previous.stock if previous is not None else _stock_name(model, current)
    settings = dataclasses.replace(settings, stock=stock,
                                   compiled=previous.compiled if previous is not None else False)
    register()
    if current != ATTN_NAME:
        log.warning("optim.packing: attention %r replaced by %r (packed documents, backend %s; a KV cache "
                    "and generate() keep %r); packing_backend='off' keeps yours", current, ATTN_NAME,
                    settings.backend, stock)
    _set_attn_implementation(model, ATTN_NAME)
    if _set_settings(model, settings) == 0:
        raise ValueError("packing.enable: found no attention modules (q_proj + layer_idx) in the model")
    configs = list({id(c): c for c in (getattr(m, "config", None) for m in (model, *_attention_modules(model)))
                    if c is not None}.values())
    routing.install(model, stock, configs)
    return model


def disable(model):
    """Undo ``enable``: the attention implementation it replaced, no routing hooks, no wrapped
    ``generate``, no prebuilt flex structures. A model it never enabled is left as it is."""
    settings = settings_of(model)
    if settings is None:
        return model
    routing.uninstall(model)
    drop_prebuilt(model)
    for m in model.modules():
        for attr in ("_optim_packing", "_optim_packing_window"):
            vars(m).pop(attr, None)
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_NAME:
        _set_attn_implementation(model, settings.stock)
    release()
    return model


def settings_of(model) -> PackingSettings | None:
    """What ``enable`` recorded on the model (kept on the transformers model under any wrapper)."""
    return vars(_owner(model)).get("_optim_packing")


def _owner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _stock_name(model, current: str | None) -> str:
    """The attention implementation transformers runs when no one names one (never ours)."""
    if current and current != ATTN_NAME:
        return current
    base = _owner(model)
    return "sdpa" if getattr(base, "_supports_sdpa", False) else "eager"


def _set_attn_implementation(model, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name


def _set_settings(model, settings: PackingSettings) -> int:
    n = 0
    for m in _attention_modules(model):
        m._optim_packing = settings
        m._optim_packing_window = _layer_window(m, None)
        n += 1
    vars(_owner(model))["_optim_packing"] = settings
    return n


def describe(model) -> dict:
    """The settings enable() recorded and the kernel ``auto`` runs on the model's device and
    dtype (empty when packing is not applied)."""
    s = settings_of(model)
    if s is None:
        return {}
    # the frozen base weights' dtype is the activations' (LoRA adapters may be fp32)
    p = next((q for q in model.parameters() if not q.requires_grad), next(model.parameters(), None))
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    route = routing.route_of(model)
    return {"packing_backend": s.backend, "packing_cache": s.cache, "validate": s.validate, "compiled_layers": s.compiled,
            "attention_split": s.split,
            "packing_backend_resolved": resolve_backend(s.backend, device, dtype, compiled=s.compiled),
            # what the forwards so far ran: packed attention, or the stock one (a KV cache, generate)
            "stock_attention": s.stock, "forwards": dict(route.calls) if route is not None else {}}


def run_stats(model) -> dict:
    """What packing did in the steps so far, for a results row: this process's counters since
    ``reset_counters()`` (metadata builds, cache hits, releases, position checks, host syncs)."""
    return {"packing_counters": dict(counters())}


__all__ = [
    "ATTN_NAME", "BACKENDS", "COUNTERS", "FLEX_BLOCK", "FORWARD_KWARG", "KERNEL_CALLS", "STRUCTURES_KWARG",
    "AUTO_ON_CUDA", "SWITCHES", "FusedFlexUnavailable", "PackedMetadata", "PackingCollator", "PackingSettings",
    "build_entry", "build_flex_block_mask", "build_sdpa_mask", "build_varlen_args", "cached_entry", "counters", "describe",
    "disable", "drop_prebuilt", "enable", "in_stock_mode", "settings_of",
    "fused_flex_failure", "kernels", "packed_attention_forward", "packed_kwargs", "prebuild_structures",
    "raise_pending", "register", "release", "reset_counters", "resolve_backend", "run_stats", "varlen_available",
]
