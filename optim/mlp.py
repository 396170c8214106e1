"""The MLP in token chunks (switch ``mlp_chunk``): no tokens x intermediate tensor is kept whole.

A SwiGLU MLP, ``down(silu(gate(x)) * up(x))`` as in Llama, Qwen and Mistral, keeps three
tokens x intermediate tensors for its backward: gate(x), up(x) and their product. On Qwen3-8B
(intermediate 12288) each is 24 KiB a token, three times the layer's hidden state, so at long
context the MLP holds most of what a recomputed layer needs.

``mlp_chunk=N`` runs each such MLP as one autograd function that keeps only its input. The
forward computes N tokens at a time and keeps nothing. The backward recomputes each chunk's gate
and up projections and takes that chunk's gradients: the input's, and those of the adapters of
all three projections, accumulated in fp32 over the chunks. The cost is the gate and up
projections run once more (two thirds of the MLP's forward); the saving is the three tensors, less
one chunk's worth. It is a trade of time for memory, so it is off by default: turn it on for
lengths that do not fit otherwise.

Without grad the chunks run too, and no tokens x intermediate tensor is made at all: the forward
of a layer whose recompute comes later runs so (``optim.offload`` runs each checkpointed layer
under ``torch.no_grad`` and recomputes it in the backward), and there the MLP's own forward would
make gate(x), up(x) and their product whole, if only for a moment.

The math is the unchunked MLP's: the same projections, biases included (peft's LoRA computed as
``optim.lora`` computes it, in the model's dtype), SiLU and its gradient as torch computes them.
An MLP it cannot compute so runs its own forward: another activation, a projection that is
neither a frozen ``nn.Linear`` nor a plain LoRA layer over one (see ``optim.lora`` for which
are), a trained base weight, or autocast to another dtype than the input's. Batches of at most N
tokens run the MLP's own forward too. The function runs outside ``torch.compile`` (``optim.regional`` compiles
the rest of the layer around it): its loop over chunks and its backward's recompute are eager.

In ``optim.offload``'s recompute of a layer (``optim._recomputing``) the layer's outputs only root
the backward. Where the layer's forward ends ``hidden_states = residual + self.mlp(...)`` and
returns that (Llama's layer and those made from it, read from its syntax tree), and no hook or
instance forward sees the outputs, the MLP's output is read by nothing; the function then keeps
its input and computes nothing: its own backward
recomputes what it needs. Under offload an unchunked MLP runs each projection forward twice a
step; a chunked one runs gate and up twice and down once (without the skip: gate and up three
times, down twice).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from optim._autocast import changes as autocast_changes
from optim._autocast import off as autocast_off
from optim._hf import owner
from optim._recomputing import unread_module
from optim.lora import PeftLinear, fused_adapter, fusable, lora_backward, lora_forward
from optim.switches import switches_of

SWITCHES = switches_of(__name__)

_STATE = "_optim_mlp"
_PROJ = ("gate_proj", "up_proj", "down_proj")
_CLASSES: dict[type, type] = {}


def _projection(module, x: torch.Tensor):
    """``(W, b, A, B, s)`` of a projection the function computes, A and B None without LoRA; None
    where it cannot (see the module docstring)."""
    if type(module) is nn.Linear:
        if module.weight.requires_grad or (module.bias is not None and module.bias.requires_grad):
            return None
        if x.dtype != module.weight.dtype or autocast_changes(x.device.type, x.dtype):
            return None  # autocast's dtypes are the MLP's own forward's to choose, as optim.lora leaves them
        return module.weight, module.bias, None, None, 0.0
    if PeftLinear is not None and isinstance(module, PeftLinear) and fusable(module):
        name = fused_adapter(module, x, {})
        if name is None:
            return None
        base = module.get_base_layer()
        return base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])
    return None


def _forward(p, x2):
    w, b, a, bb, s = p
    if a is None:
        return torch.nn.functional.linear(x2, w, b), None
    return lora_forward(x2, w, b, a, bb, s)


def _backward(p, g, x2, xa, acc, k):
    """Gradient reaching x2; the adapters' fp32 gradients added into ``acc[k]``, ``acc[k + 1]``."""
    w, _, a, bb, s = p
    if a is None:
        return g @ w
    gx, ga, gb = lora_backward(g, x2, xa, w, a.float(), bb.float(), s, True, acc[k] is not None, acc[k + 1] is not None)
    for i, grad in ((k, ga), (k + 1, gb)):
        if grad is not None:
            acc[i].add_(grad)
    return gx


class _ChunkedMLP(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)), ``chunk`` tokens at a time, keeping only x."""

    @staticmethod
    def forward(ctx, x, chunk: int, compute: bool, scalings: tuple, biases: tuple, *tensors):
        projs = _unflatten(tensors, scalings, biases)
        x2 = x.reshape(-1, x.shape[-1])
        # compute=False: a recompute whose output nobody reads (see _chunked); zeros keep it defined
        out = (x2.new_empty if compute else x2.new_zeros)(x2.shape[0], projs[2][0].shape[0])
        for i in range(0, x2.shape[0] if compute else 0, chunk):
            xc = x2[i:i + chunk]
            h = torch.nn.functional.silu(_forward(projs[0], xc)[0]) * _forward(projs[1], xc)[0]
            out[i:i + chunk] = _forward(projs[2], h)[0]
        ctx.save_for_backward(x, *tensors)
        ctx.chunk, ctx.scalings, ctx.biases = chunk, scalings, biases
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            return _ChunkedMLP._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, *tensors = ctx.saved_tensors
        projs = _unflatten(tensors, ctx.scalings, ctx.biases)
        need = ctx.needs_input_grad[5:]
        # fp32 accumulators for the adapters' gradients, in the tensors' order (W, [b], A, B per projection)
        acc = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if n and t is not None else None
               for t, n in zip(_slots(tensors, ctx.biases), _slots(need, ctx.biases))]
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        for i in range(0, x2.shape[0], ctx.chunk):
            xc, gc = x2[i:i + ctx.chunk], g2[i:i + ctx.chunk]
            gate, xa_gate = _forward(projs[0], xc)
            up, xa_up = _forward(projs[1], xc)
            act = torch.nn.functional.silu(gate)
            h = act * up
            xa_down = None if projs[2][2] is None else h @ projs[2][2].to(h.dtype).t()
            grad_h = _backward(projs[2], gc, h, xa_down, acc, 10)
            del h
            grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
            grad_up = grad_h * act
            del grad_h, act, up, gate
            gx = _backward(projs[0], grad_gate, xc, xa_gate, acc, 2)
            gx += _backward(projs[1], grad_up, xc, xa_up, acc, 6)
            if grad_x is not None:
                grad_x[i:i + ctx.chunk] = gx
        grads = [None if a is None else a.to(t.dtype) for a, t in zip(acc, _slots(tensors, ctx.biases))]
        packed = [g for g, has in zip(grads, _present(ctx.biases)) if has]
        return (None if grad_x is None else grad_x.reshape(x.shape), None, None, None, None, *packed)


# The function's tensors, flattened: per projection W, then b where it has one, then A and B where
# it has LoRA (``scalings`` holds None for a projection without). ``_slots`` lays them out as four
# slots per projection (W, b, A, B), None where absent, so the backward indexes them alike.
def _present(biases) -> list[bool]:
    return [has for bias in biases for has in (True, bias, True, True)]


def _slots(tensors, biases) -> list:
    it = iter(tensors)
    out = []
    for bias in biases:
        out += [next(it), next(it) if bias else None, next(it), next(it)]
    return out


def _unflatten(tensors, scalings, biases):
    """Per projection ``(W, b, A, B, s)``, A and B None where it has no LoRA."""
    slots = _slots(tensors, biases)
    return [(slots[4 * k], slots[4 * k + 1], *((slots[4 * k + 2], slots[4 * k + 3]) if scalings[k] is not None
                                                else (None, None)), scalings[k]) for k in range(3)]


def _pack(projs):
    """The function's flat tensors: A and B of a projection without LoRA passed as empty
    placeholders (the slot layout stays fixed)."""
    tensors, scalings, biases = [], [], []
    for w, b, a, bb, s in projs:
        tensors.append(w)
        if b is not None:
            tensors.append(b)
        tensors += [a if a is not None else _NONE.get(w), bb if bb is not None else _NONE.get(w)]
        scalings.append(s if a is not None else None)
        biases.append(b is not None)
    return tensors, tuple(scalings), tuple(biases)


class _Empty:
    """A 0-element tensor per device and dtype, standing in for absent adapters."""

    def __init__(self):
        self.cache = {}

    def get(self, like):
        key = (like.device, like.dtype)
        if key not in self.cache:
            with torch.inference_mode(False):  # made in inference_mode, it could never be saved for a backward
                self.cache[key] = torch.empty(0, device=like.device, dtype=like.dtype)
        return self.cache[key]


_NONE = _Empty()


def _projections(mlp, x):
    projs = [_projection(getattr(mlp, name), x) for name in _PROJ]
    return None if any(p is None for p in projs) else projs


@torch.compiler.disable
def _chunked(mlp, x, chunk: int):
    projs = _projections(mlp, x)
    if projs is None:
        return None
    tensors, scalings, biases = _pack(projs)
    state = vars(mlp)
    state["_optim_mlp_calls"] = state.get("_optim_mlp_calls", 0) + 1
    # In optim.offload's recompute of this MLP's own layer, whose forward ends ``residual +
    # mlp(...)``, the output's value is read by nothing (the add's backward reads none): keep x,
    # compute nothing.
    layer = unread_module()
    skip = (layer is not None and torch.is_grad_enabled() and layer._modules.get("mlp") is mlp
            and _residual_tail(type(layer)) and _runs_as_its_class(layer) and _runs_as_its_class(mlp))
    if skip:
        state["_optim_mlp_skipped"] = state.get("_optim_mlp_skipped", 0) + 1
    return _ChunkedMLP.apply(x, chunk, not skip, scalings, biases, *tensors)


# Forward hooks that read nothing in a recompute: transformers' output capture (installed on the
# layers once ``output_hidden_states`` is asked for) collects only inside the model's forward.
_IDLE_HOOKS = ("transformers/utils/output_capturing.py",)


def _runs_as_its_class(module: nn.Module) -> bool:
    """No forward set on the instance and no forward hook, its own or global, but idle ones:
    nothing but the class's forward sees the module's output."""
    def idle(hook) -> bool:
        code = getattr(hook, "__code__", None)
        return code is not None and code.co_filename.replace("\\", "/").endswith(_IDLE_HOOKS)

    return ("forward" not in vars(module) and all(idle(h) for h in module._forward_hooks.values())
            and not torch.nn.modules.module._global_forward_hooks)


def _chunked_forward(self, x, *args, **kwargs):
    chunk = vars(self).get("_optim_mlp_chunk")
    tokens = x.numel() // x.shape[-1]
    if args or kwargs or not isinstance(chunk, int) or tokens <= chunk:
        return super(type(self), self).forward(x, *args, **kwargs)
    out = _chunked(self, x, chunk)
    return super(type(self), self).forward(x) if out is None else out


def _is_swiglu(m: nn.Module) -> bool:
    own = m._modules  # its own children: a peft wrapper forwards attribute lookups to the model inside
    act = own.get("act_fn")
    return (all(isinstance(own.get(n), nn.Module) for n in _PROJ) and act is not None
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


# The last statements of a decoder layer's forward (Llama's, and the families generated from it)
# where the MLP's output is only added to the residual and returned. Any other ending computes.
_TAIL = ("hidden_states = self.mlp(hidden_states)", "hidden_states = residual + hidden_states", "return hidden_states")
# Wrappers a class's forward may sit in that pass the output on untouched: transformers' kwarg
# renames and its checkpointing entry (by the file that defines the wrapper's code).
_PLAIN_WRAPPERS = ("transformers/utils/deprecation.py", "transformers/modeling_layers.py")
_TAILS: dict[type, bool] = {}  # per class; a dict, not a cache that would keep classes alive forever


def _innermost(func):
    """The function ``func`` wraps through plain wrappers only; None past any other wrapper."""
    for _ in range(16):
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            return func
        code = getattr(func, "__code__", None)
        if code is None or not code.co_filename.replace("\\", "/").endswith(_PLAIN_WRAPPERS):
            return None
        func = inner
    return None


def _residual_tail(cls: type) -> bool:
    """Whether ``cls.forward``, read from its source, calls ``self.mlp`` once, and its last three
    top-level statements are ``_TAIL``: the MLP's output goes to the residual add alone, and the
    sum is returned. Anything else, or a source not found, is False."""
    if cls not in _TAILS:
        _TAILS[cls] = _reads_tail(cls)
    return _TAILS[cls]


def _reads_tail(cls: type) -> bool:
    import ast
    import textwrap

    func = _innermost(vars(cls).get("forward") or getattr(cls, "forward", None))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.body) < len(_TAIL):
        return False
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "mlp"
             and isinstance(n.value, ast.Name) and n.value.id == "self"]
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    last = tuple(ast.unparse(st) for st in fn.body[-len(_TAIL):])
    return last == _TAIL and len(calls) == 1 and len(returns) == 1


def _chunked_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Chunked{cls.__name__}", (cls,), {"forward": _chunked_forward, "_optim_base": cls})
    return _CLASSES[cls]


def enable(model: nn.Module, **settings: Any) -> nn.Module:
    """Apply ``mlp_chunk`` to every SwiGLU MLP of ``model``; returns it. Parameters and state-dict
    keys are unchanged."""
    unknown = set(settings) - set(SWITCHES)
    if unknown:
        raise TypeError(f"unknown optim.mlp settings: {sorted(unknown)} (valid: {sorted(SWITCHES)})")
    chunk = SWITCHES["mlp_chunk"].resolve(settings.get("mlp_chunk"))
    disable(model)
    mlps = [m for m in model.modules() if _is_swiglu(m)] if chunk != "off" else []
    for m in mlps:
        m.__class__ = _chunked_class(type(m))
        m._optim_mlp_chunk = chunk
    for layer in model.modules():
        mlp = layer._modules.get("mlp")
        if mlp is not None and "_optim_mlp_chunk" in vars(mlp) and _residual_tail(type(layer)):
            mlp._optim_mlp_tail = True  # counted by describe(); _chunked reads the layer itself
    vars(owner(model))[_STATE] = {"mlp_chunk": chunk, "chunked_mlps": len(mlps)}
    return model


def disable(model: nn.Module) -> nn.Module:
    for m in model.modules():
        base = vars(type(m)).get("_optim_base")
        if base is not None:
            m.__class__ = base
            for key in ("_optim_mlp_chunk", "_optim_mlp_calls", "_optim_mlp_tail", "_optim_mlp_skipped"):
                vars(m).pop(key, None)
    vars(owner(model)).pop(_STATE, None)
    return model


def run_stats(model: nn.Module) -> dict[str, Any]:
    """How many MLP calls ran in chunks in the steps so far, for a results row."""
    return {"mlp_stats": describe(model) or None}


def describe(model: nn.Module) -> dict[str, Any]:
    """What enable() did, and how many MLP calls ran chunked since (empty when not applied)."""
    state = vars(owner(model)).get(_STATE)
    if state is None:
        return {}
    mods = list(model.modules())
    return {**state, "tail_mlps": sum(bool(vars(m).get("_optim_mlp_tail")) for m in mods),
            "chunked_calls": sum(vars(m).get("_optim_mlp_calls", 0) for m in mods),
            "recompute_skips": sum(vars(m).get("_optim_mlp_skipped", 0) for m in mods)}
