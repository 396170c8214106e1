"""What the optim modules read off a transformers model (peft-wrapped or not), and the names that
moved between transformers releases."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

# The KV cache's keyword: ``past_key_values`` up to transformers 5.23; ``cache`` from 5.24, where
# the old name is deprecated (removed in 5.40).
CACHE_KWARGS = ("past_key_values", "cache")


def causal_lm(model):
    """The transformers *ForCausalLM inside a peft wrapper (or the model itself), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "lm_head") and hasattr(base, "model"):
        return base
    return None


def owner(model):
    """The transformers model under any peft wrapper: where optim keeps its per-model state, so
    that enabling or disabling through the wrapper or the bare model finds the same state."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# nn.DataParallel calls this on every module of the model at every forward to make its replicas,
# each a copy of the module's __dict__: a forward optim bound to the module there would run the
# original, on the first GPU's weights, and fail with a device mismatch deep inside.
REPLICATE = "_replicate_for_data_parallel"
DATA_PARALLEL = (
    "optim: nn.DataParallel is not supported: its replicas would run the forwards optim bound to the "
    "model on the first GPU's weights and fail with a device mismatch. Trainer wraps a model in "
    "DataParallel when it sees several GPUs and no launcher: launch with torchrun or accelerate (one "
    "process per GPU), or make one GPU visible (CUDA_VISIBLE_DEVICES=0)")


def _refuse_data_parallel():
    raise RuntimeError(DATA_PARALLEL)


def refuse_data_parallel(module, on: bool = True) -> None:
    """Make nn.DataParallel stop at ``module`` with DATA_PARALLEL (``on``), or lift that. A plain
    function in the instance's __dict__, not a bound method: no reference cycle through it."""
    if on:
        vars(module)[REPLICATE] = _refuse_data_parallel
    elif vars(module).get(REPLICATE) is _refuse_data_parallel:
        del vars(module)[REPLICATE]


def cache_of(kwargs: dict):
    """The KV cache a forward call was given under either name, or None."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


@functools.lru_cache(maxsize=None)
def cache_kwarg(forward) -> str:
    """The name ``forward`` takes its KV cache under (the newest name where it takes both)."""
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@functools.lru_cache(maxsize=None)
def output_cache_field(output_cls) -> str:
    names = {f.name for f in dataclasses.fields(output_cls)}
    return "cache" if "cache" in names else "past_key_values"


# What a causal LM's forward may do between its decoder's output and its logits for the fused loss
# (optim.loss), which computes lm_head(hidden) itself, to give the same loss: take the hidden
# states, slice the positions to keep, apply lm_head. Transformers' versions write it either way.
_PLAIN_HIDDEN = {"hidden_states = outputs.last_hidden_state", "hidden_states = outputs[0]",
                 "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
                 "hidden_states = hidden_states[:, slice_indices, :]"}
_PLAIN_LOGITS = {"logits = self.lm_head(hidden_states)", "logits = self.lm_head(hidden_states[:, slice_indices, :])"}
_ASSIGNS = re.compile(r"(logits|hidden_states) (=|\*=|/=|\+=|-=) ")  # an assignment, not a keyword (logits=logits)


@functools.lru_cache(maxsize=None)
def logits_beyond_lm_head(cls) -> str | None:
    """The first statement of ``cls.forward`` that makes its logits more than ``lm_head`` of the
    decoder's last hidden states (a scale, a softcap, a cast, another head), or None where there is
    none. Read from the source, so a model or a transformers version this was not written against
    is judged by what it does; a forward whose source cannot be read is not plain."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return "its forward's source cannot be read"
    seen_logits = False
    for raw in src.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not _ASSIGNS.match(line):
            continue
        if line.startswith("logits"):
            seen_logits = True
            if line not in _PLAIN_LOGITS:
                return line
        elif line not in _PLAIN_HIDDEN:
            return line
    return None if seen_logits else "its forward assigns no logits = self.lm_head(hidden_states)"
