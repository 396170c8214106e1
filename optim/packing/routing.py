"""Which attention each forward of an enabled model runs.

Packed attention serves calls without a KV cache (training, evaluation, a prefill that keeps no
cache), where the batch's documents are known: ``packing=``, ``cu_seq_lens_q``, position_ids
restarting per document, or an ``attention_mask`` with left or right padding, whose runs of real
and padding tokens become the documents (every real token then attends to exactly the real
tokens before it, as stock does). Anything else runs the attention implementation ``enable``
replaced, with transformers' own masks: a call given a KV cache (``generate``, a decoding loop),
a 4-D or prepared mask, and all of ``generate``. Nothing is ignored: a mask that fits neither,
padding between a row's real tokens, is refused with the reason.

The decoder stack (the module holding ``layers``) gets a forward pre-hook, which turns a padded
mask into documents, and its ``forward`` is wrapped so that a stock call runs inside a ``with``
(an interrupt cannot leave the model in stock mode); ``generate`` of the causal LM is wrapped too.
Every piece finds the model's ``Route`` on the module it is called on, so a deep copy of the model
routes its own calls. ``uninstall`` removes all of it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import types

import torch

from optim._hf import cache_of, causal_lm, refuse_data_parallel
from optim.packing.metadata import ATTN_NAME, COUNTERS, FILLED_FROM, FORWARD_KWARG, PackedMetadata, padding_documents

_LOCAL = threading.local()
_ATTR = "_optim_packing_route"
_OWN_GENERATE = "_optim_packing_own_generate"  # a generate the instance had before enable (a repo's custom_generate)
log = logging.getLogger("optim.packing")


def in_stock_mode() -> bool:
    """True inside a forward (or ``generate``) that runs the stock attention: compiled layers
    (``optim.regional``) run eager there too."""
    return getattr(_LOCAL, "depth", 0) > 0


class Route:
    """One model's stock attention implementation and the configs that name it."""

    def __init__(self, stock: str, configs: list):
        self.stock = stock
        self.configs = configs
        self.calls = {"packed": 0, "stock": 0, "padded_batches": 0}
        self.told_left = False
        self._lock = threading.Lock()
        self._stock_depth = 0  # stock calls in flight, every thread: the configs name stock while > 0
        self._saved: list = []

    def __getstate__(self):  # a deep copy of the model copies its route, lock excepted
        state = dict(self.__dict__)
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def stock_attention(self):
        """The model runs its stock attention (and transformers builds its masks) inside."""
        with self._lock:
            if self._stock_depth == 0:
                self._saved = [(c, getattr(c, "_attn_implementation_internal", None)) for c in self.configs]
                for c, _ in self._saved:
                    c._attn_implementation_internal = self.stock
            self._stock_depth += 1
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            yield
        finally:
            _LOCAL.depth -= 1
            with self._lock:
                self._stock_depth -= 1
                if self._stock_depth == 0:
                    for c, value in self._saved:
                        c._attn_implementation_internal = value
                    self._saved = []

    def wants_stock(self, kwargs: dict) -> bool:
        if in_stock_mode() or cache_of(kwargs) is not None:
            return True
        mask = kwargs.get("attention_mask")
        return mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)

    def packed_named(self) -> bool:
        """Every config names the packed attention: not so after the user set another one (or
        while another thread runs a stock call), and then the model runs as its config says."""
        return all(getattr(c, "_attn_implementation_internal", ATTN_NAME) == ATTN_NAME for c in self.configs)


def _route(module) -> Route:
    return vars(module)[_ATTR]


def _rewrite_kwargs(module, args, kwargs):
    """Forward pre-hook of the decoder stack, ahead of every other: a padded mask becomes the
    batch's documents, and documents without position_ids get theirs."""
    route = _route(module)
    if len(args) > 1:  # by keyword from here on: the mask and positions are read by name
        args, kwargs = _by_keyword(type(module).forward, args, kwargs)
    if route.wants_stock(kwargs) or not route.packed_named():
        return args, kwargs
    new = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if mask is not None:  # 2-D: its padding becomes documents, or it says nothing
        new["attention_mask"] = None
        meta, left = padding_documents(mask)
        if meta is not None:
            if kwargs.get(FORWARD_KWARG) is not None or kwargs.get("cu_seq_lens_q") is not None:
                raise ValueError("packing: this batch has an attention_mask with padding and also packed "
                                 "documents (packing= or cu_seq_lens_q); pass one of the two")
            new[FORWARD_KWARG] = meta
            route.calls["padded_batches"] += 1
            if left and module.training and not route.told_left:
                route.told_left = True
                log.warning("optim.packing: left-padded rows in training. Real tokens attend as with stock "
                            "attention; a padding position attends to the padding before it, so a label "
                            "it predicts (each row's first real token, unless labels mask it with -100) "
                            "gets another loss term than stock's, whose padding rows depend on its kernel. "
                            "Pad on the right to train, or mask that label")
    meta = new.get(FORWARD_KWARG)
    if isinstance(meta, PackedMetadata) and meta.source == "lengths" and new.get("position_ids") is None:
        # the model would count positions 0..T-1 across the row; the documents restart them
        ref = next((new[k] for k in ("input_ids", "inputs_embeds") if new.get(k) is not None),
                   args[0] if args else None)
        pos = meta.position_ids()
        if ref is not None:
            if tuple(ref.shape[:2]) != (meta.batch_size, meta.seq_len):
                raise ValueError(f"packing: metadata describes {meta.batch_size}x{meta.seq_len} tokens but "
                                 f"the batch is {ref.shape[0]}x{ref.shape[1]}")
            pos = pos.to(ref.device, non_blocking=True)
        setattr(pos, FILLED_FROM, ("meta", meta.serial))  # nothing to check against their own metadata
        new["position_ids"] = pos
        COUNTERS["position_ids_from_metadata"] += 1
    return args, new


def _by_keyword(forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Every positional argument but the first (input_ids) as the keyword it binds to."""
    names = [p.name for p in inspect.signature(forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # without self
    return args[:1], {**dict(zip(names[1:], args[1:])), **kwargs}


def _routed_forward(self, *args, **kwargs):
    """The decoder stack's forward: stock calls inside the stock context, packed ones checked."""
    route = _route(self)
    if route.wants_stock(kwargs):
        route.calls["stock"] += 1
        with route.stock_attention():
            return type(self).forward(self, *args, **kwargs)
    if not route.packed_named():  # the implementation the user set since enable(): as configured
        route.calls["stock"] += 1
        return type(self).forward(self, *args, **kwargs)
    route.calls["packed"] += 1
    return type(self).forward(self, *args, **kwargs)


def _routed_generate(self, *args, **kwargs):
    """``generate`` with the stock attention throughout (its masks are built before any forward):
    the instance's own generate where it had one (transformers sets a repo's ``custom_generate``
    on the instance), else the class's."""
    own = vars(self).get(_OWN_GENERATE)
    with _route(self).stock_attention():
        if own is not None:
            return own(*args, **kwargs)
        return type(self).generate(self, *args, **kwargs)


def decoder_stacks(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]


def install(model, stock: str, configs: list) -> Route:
    """Route every forward of ``model``'s decoder stacks and its ``generate`` (idempotent)."""
    route = route_of(model)
    if route is not None:
        return route
    route = Route(stock, configs)
    for stack in decoder_stacks(model):
        vars(stack)[_ATTR] = route
        # prepended: optim.regional's prebuild hook must see the documents this one hands on
        stack.register_forward_pre_hook(_rewrite_kwargs, with_kwargs=True, prepend=True)
        vars(stack)["forward"] = types.MethodType(_routed_forward, stack)
        refuse_data_parallel(stack)
    lm = causal_lm(model)
    if lm is not None and hasattr(type(lm), "generate"):
        vars(lm)[_ATTR] = route
        if "generate" in vars(lm):
            vars(lm)[_OWN_GENERATE] = vars(lm)["generate"]
        vars(lm)["generate"] = types.MethodType(_routed_generate, lm)
    return route


def uninstall(model) -> Route | None:
    route = route_of(model)
    for m in model.modules():
        if vars(m).pop(_ATTR, None) is None:
            continue
        remove_pre_hook(m, _rewrite_kwargs)
        refuse_data_parallel(m, on=False)
        for name in ("forward", "generate"):
            fn = vars(m).get(name)
            if isinstance(fn, types.MethodType) and fn.__func__ in (_routed_forward, _routed_generate):
                del vars(m)[name]
        own = vars(m).pop(_OWN_GENERATE, None)
        if own is not None:  # the instance's own generate, as enable found it
            vars(m)["generate"] = own
    return route


def remove_pre_hook(module: torch.nn.Module, fn) -> None:
    """Remove every forward pre-hook of ``module`` that is ``fn`` (registered by function, so a
    deep copy's hooks are found too, where a handle would point at the original's)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is fn:
            module._forward_pre_hooks.pop(key)
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def route_of(model) -> Route | None:
    return next((vars(m)[_ATTR] for m in model.modules() if _ATTR in vars(m)), None)
