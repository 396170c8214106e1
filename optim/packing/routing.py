"""Which attention each forward of an enabled model runs.

Packed attention serves calls without a KV cache (training, evaluation, a prefill that keeps no
cache), where the batch's documents are known: ``packing=``, ``cu_seq_lens_q``, position_ids
restarting per document, or an ``attention_mask`` with left or right padding, whose runs of real
and padding tokens become the documents (every real token then attends to exactly the real
tokens before it, as stock does). Anything else runs the attention implementation ``enable``
replaced, with transformers' own masks: a call given a KV cache (``generate``, a decoding loop),
a 4-D or prepared mask, and all of ``generate``. Nothing is ignored: a mask that fits neither,
padding between a row's real tokens, is refused with the reason.

The decoder stack (the module holding ``layers``) gets a forward pre-hook and an always-called
forward hook; ``generate`` of the causal LM is wrapped. ``uninstall`` removes all three.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from optim._hf import cache_of, causal_lm
from optim.packing.metadata import COUNTERS, FORWARD_KWARG, PackedMetadata, padding_documents

_LOCAL = threading.local()
_ATTR = "_optim_packing_route"
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
        self.handles: list = []
        self.generate_owner = None  # the causal LM whose generate is wrapped
        self.calls = {"packed": 0, "stock": 0, "padded_batches": 0}
        self.told_left = False

    @contextlib.contextmanager
    def stock_attention(self):
        """The model runs its stock attention (and transformers builds its masks) inside."""
        saved = [(c, getattr(c, "_attn_implementation_internal", None)) for c in self.configs]
        for c, _ in saved:
            c._attn_implementation_internal = self.stock
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            yield
        finally:
            _LOCAL.depth -= 1
            for c, value in saved:
                c._attn_implementation_internal = value


def _wants_stock(kwargs: dict) -> bool:
    if cache_of(kwargs) is not None:
        return True
    mask = kwargs.get("attention_mask")
    return mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)


def _pre_hook(route: Route):
    def hook(module, args, kwargs):
        entered = module.__dict__.setdefault("_optim_packing_entered", [])
        if _wants_stock(kwargs) or in_stock_mode():
            ctx = route.stock_attention()
            ctx.__enter__()
            entered.append(ctx)
            route.calls["stock"] += 1
            return None
        entered.append(None)
        route.calls["packed"] += 1
        new = None
        mask = kwargs.get("attention_mask")
        if mask is not None:  # 2-D: its padding becomes documents, or it says nothing
            new = dict(kwargs, attention_mask=None)
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
        cur = new if new is not None else kwargs
        meta = cur.get(FORWARD_KWARG)
        if isinstance(meta, PackedMetadata) and meta.source == "lengths" and cur.get("position_ids") is None:
            # the model would count positions 0..T-1 across the row; the documents restart them
            ref = next((cur[k] for k in ("input_ids", "inputs_embeds") if cur.get(k) is not None),
                       args[0] if args else None)
            pos = meta.position_ids()
            if ref is not None:
                if tuple(ref.shape[:2]) != (meta.batch_size, meta.seq_len):
                    raise ValueError(f"packing: metadata describes {meta.batch_size}x{meta.seq_len} tokens but "
                                     f"the batch is {ref.shape[0]}x{ref.shape[1]}")
                pos = pos.to(ref.device, non_blocking=True)
            new = dict(cur, position_ids=pos)
            COUNTERS["position_ids_from_metadata"] += 1
        return (args, new) if new is not None else None

    return hook


def _post_hook(module, args, kwargs, output):
    entered = module.__dict__.get("_optim_packing_entered")
    ctx = entered.pop() if entered else None
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return None


def _stacks(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]


def install(model, stock: str, configs: list) -> Route:
    """Route every forward of ``model``'s decoder stacks and its ``generate`` (idempotent)."""
    route = getattr(model, _ATTR, None)
    if route is not None:
        return route
    route = Route(stock, configs)
    for stack in _stacks(model):
        # prepended: optim.regional's prebuild hook must see the documents this one hands on
        route.handles.append(stack.register_forward_pre_hook(_pre_hook(route), with_kwargs=True, prepend=True))
        route.handles.append(stack.register_forward_hook(_post_hook, with_kwargs=True, always_call=True))
    lm = causal_lm(model)
    if lm is not None and hasattr(lm, "generate") and "generate" not in vars(lm):
        stock_generate = lm.generate

        def generate(*args, **kwargs):
            with route.stock_attention():
                return stock_generate(*args, **kwargs)

        generate.__doc__ = stock_generate.__doc__
        lm.generate = generate
        route.generate_owner = lm
    object.__setattr__(model, _ATTR, route)
    return route


def uninstall(model) -> Route | None:
    route = getattr(model, _ATTR, None)
    if route is None:
        return None
    for h in route.handles:
        h.remove()
    route.handles.clear()
    if route.generate_owner is not None:
        vars(route.generate_owner).pop("generate", None)
        route.generate_owner = None
    object.__delattr__(model, _ATTR)
    return route


def route_of(model) -> Route | None:
    return getattr(model, _ATTR, None)
