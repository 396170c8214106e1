"""The causal-LM loss without the full logits: lm_head and cross-entropy in token chunks, with the
gradients computed chunk by chunk in the forward.

Stock transformers computes ``logits = lm_head(hidden)`` for every token, upcasts them to fp32 and
takes the cross-entropy: with a 152k-word vocabulary that is 4.6 GiB of fp32 logits at 8192 tokens,
plus their gradient, and it sets the peak of a LoRA step on Qwen3 models. Here each chunk's logits
exist only while that chunk is processed: its loss and the gradient with respect to the hidden
states (and to the lm_head weight, when it trains) are computed at once, and only the hidden-state
gradient (the size of the hidden states) is kept for the backward, and the backward scales it in
place. The lm_head matmul runs twice per token (logits, then gradient), never three times as with
checkpointed chunks.

A chunk's softmax gradient is written over its logits (``loss_kernel``): on CUDA by one compiled
kernel, so the chunk's logits exist once, in the model dtype, and never in fp32.
``python -m harness.bench.loss`` times each kernel beside stock and Liger-Kernel
(reports/loss). cut-cross-entropy (``loss_kernel="cce"``, opt-in) holds less memory still, but
its hidden-state gradient is further from an fp32 computation than stock's, so it is not the
default.

The value equals transformers' ``ForCausalLMLoss``: labels shifted by one (or ``shift_labels`` as
given), ``-100`` ignored, the sum divided by ``num_items_in_batch`` when the trainer passes it
(gradient accumulation) and by the number of counted tokens otherwise. No host sync: the count
stays on the device, so a captured CUDA graph can replay it.

Use::

    import optim.loss
    optim.loss.enable(model)                 # model(..., labels=...).loss now comes from here
    loss = optim.loss.linear_cross_entropy(hidden, lm_head.weight, shifted_labels)  # or directly

``enable`` patches the causal-LM instance's ``forward`` (peft-wrapped or not), so
``model(**batch)``, ``transformers.Trainer`` and TRL get it with no code change. In training mode
with labels it returns ``logits=None`` (as Liger-Kernel does); in eval mode, or without labels, the
stock forward runs and returns logits. Models whose loss needs the logits (soft-capped logits,
router auxiliary loss) keep the stock forward, with one log line saying why. So does a call under
autocast to another dtype than lm_head's (Trainer's ``bf16=True`` over fp32 weights); under
autocast to lm_head's own dtype (``bf16=True`` over a bf16 model) the fused loss runs, on the
hidden states cast as autocast would cast them, with autocast off inside (its fp32 math stays fp32).
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch
import torch.nn.functional as F

from optim._autocast import changes as autocast_changes
from optim._autocast import off as autocast_off
from optim._fallback import passes_through, recompile_limit
from optim._hf import cache_kwarg, causal_lm, logits_beyond_lm_head, output_cache_field, refuse_data_parallel
from optim.switches import Switch, switches_of

log = logging.getLogger("optim.loss")

IGNORE_INDEX = -100
# fp32 logits of one chunk: a chunk has this many bytes of them (rounded down to a power of two
# of tokens, at least 64), so the transient memory does not grow with the batch.
CHUNK_LOGIT_BYTES = 256 * 2**20
_ATTR = "_optim_loss_forward"
_KERNEL = "_optim_loss_kernel"
_PATHS = "_optim_loss_paths"  # training calls with labels, per loss path

SWITCHES: dict[str, Switch] = switches_of("optim.loss")


def chunk_tokens(vocab_size: int, budget_bytes: int = CHUNK_LOGIT_BYTES) -> int:
    """Tokens per chunk: a power of two whose fp32 logits fit ``budget_bytes`` (at least 64)."""
    n = max(64, budget_bytes // (4 * max(1, vocab_size)))
    return 1 << (n.bit_length() - 1)


def _softmax_grad_eager_(logits: torch.Tensor, labels: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """One chunk, op by op: the summed cross-entropy of ``logits`` (model dtype) against ``labels``
    (``-100`` ignored) is returned, and d(sum · inv)/d logits is written into ``logits``. One fp32
    copy of the chunk's logits exists meanwhile (none when they are fp32 already)."""
    x = logits.float()  # stock's order: the matmul in the model dtype, then fp32
    valid = labels != IGNORE_INDEX
    target = labels.masked_fill(~valid, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    # d loss / d logits = (softmax − one-hot) · inv on counted rows, 0 elsewhere
    g = x.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, target[:, None], torch.full_like(picked[:, None], -1.0))
    g.mul_((valid.float() * inv)[:, None])
    if g.data_ptr() != logits.data_ptr():
        logits.copy_(g)
    return loss


def _softmax_grad_(logits: torch.Tensor, labels: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``_softmax_grad_eager_``'s math written pointwise (the one-hot as a comparison), so that
    inductor makes it a reduction and one pointwise kernel storing into ``logits``: the chunk's
    fp32 logits live only in registers."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]
    g = (torch.exp(x - lse[:, None]) - hit.to(x.dtype)) * (valid.to(x.dtype) * inv)[:, None]
    logits.copy_(g)
    return loss


class _CompiledChunk:
    """``_softmax_grad_`` compiled once per process; eager from the first compiler failure on."""

    def __init__(self):
        self.fn = None
        self.failed: str | None = None

    def __call__(self, logits, labels, inv):
        if self.failed is None:
            if self.fn is None:
                self.fn = torch.compile(_softmax_grad_, dynamic=None)
            try:
                return self.fn(logits, labels, inv)
            except Exception as e:  # a compiler failure must not stop training
                if passes_through(e):
                    raise
                self.failed = f"{type(e).__name__}: {str(e).strip()[:200]}"
                log.warning("optim.loss: torch.compile of the loss chunk failed, running it eager from "
                            "now on (%s)", self.failed)
        return _softmax_grad_eager_(logits, labels, inv)


_compiled_chunk = _CompiledChunk()


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``loss_kernel`` as it runs on ``device``: auto is compiled on CUDA, eager elsewhere; cce
    needs the ``cut_cross_entropy`` package and CUDA and says so when missing."""
    if kernel == "auto":
        return "compiled" if device.type == "cuda" else "eager"
    if kernel == "cce":
        if device.type != "cuda":
            raise ValueError("loss_kernel='cce': cut-cross-entropy runs on CUDA only")
        try:
            import cut_cross_entropy  # noqa: F401
        except ImportError as e:
            raise ImportError("loss_kernel='cce' needs the cut-cross-entropy package "
                              "(pip install cut-cross-entropy)") from e
    return kernel


def _accumulate(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc += g.T @ h, with an fp32 ``acc`` and model-dtype ``g``, ``h``: on CUDA in one cuBLAS
    call accumulating in fp32 (no product in the model dtype, no temporary of the weight's size)."""
    if g.dtype == acc.dtype:
        acc.addmm_(g.t(), h)
    elif acc.is_cuda:
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:
        acc += (g.t() @ h).float()


def _chunks(step, hidden, weight, labels, inv, chunk, total, grad_h, grad_w):
    """The forward's loop: per chunk the logits, its loss and gradient (``step``), and its share
    of the hidden-state and weight gradients. Returns the summed loss."""
    for i in range(0, hidden.shape[0], chunk):
        h, y = hidden[i:i + chunk], labels[i:i + chunk]
        logits = h @ weight.t()
        total = total + step(logits, y, inv)  # logits now hold d loss / d logits
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[i:i + chunk])
        if grad_w is not None:
            _accumulate(grad_w, logits, h)
        del logits  # before the next chunk's are allocated: one chunk's logits at a time
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over counted tokens of CE(hidden @ weight.T, labels) / denom, gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, denom, chunk: int | None, kernel: str):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        # with a trained lm_head every chunk adds into the fp32 weight gradient: 4x fewer, larger
        # chunks read and write it 4x less often (their bf16 logits hold twice the bytes of the
        # fp32 budget)
        chunk = chunk or chunk_tokens(weight.shape[0]) * (4 if want_w else 1)
        step = _compiled_chunk if kernel == "compiled" else _softmax_grad_eager_
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        inv = 1.0 / denom.float()
        # the compiled chunk kernel keeps an entry per shape seen (full chunks, each tail length
        # until dynamo makes the length dynamic): optim's own limit, set once per call
        with recompile_limit() if kernel == "compiled" else contextlib.nullcontext():
            total = _chunks(step, hidden, weight, labels, inv, chunk, total, grad_h, grad_w)
        ctx.grad_h, ctx.grad_w = grad_h, grad_w  # not saved tensors: backward scales them in place
        return total * inv

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grad_h, ctx.grad_w
        if grad_h is None and grad_w is None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            raise RuntimeError("optim.loss: a second backward through the fused loss (retain_graph=True); "
                               "its gradients were computed in the forward and are handed out once")
        ctx.grad_h = ctx.grad_w = None
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))  # in place: no second hidden-sized buffer
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def _cce(hidden, weight, labels, denom):
    from cut_cross_entropy import linear_cross_entropy as cce

    # exact gradients (filter_eps=None): the default filter drops small softmax entries
    return cce(hidden, weight, labels, ignore_index=IGNORE_INDEX, reduction="sum", filter_eps=None) / denom.float()


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         num_items_in_batch: torch.Tensor | int | None = None,
                         chunk: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (already aligned: ``labels[t]``
    is the token position ``t`` predicts; ``-100`` ignored), divided by ``num_items_in_batch`` when
    given, else by the counted tokens. ``hidden``: (..., H); ``labels``: the same leading shape.
    ``kernel``: see the ``loss_kernel`` switch (inside a CUDA-graph capture cce runs as compiled:
    it syncs with the host)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"linear_cross_entropy: {h.shape[0]} hidden rows but {y.shape[0]} labels")
    if num_items_in_batch is None:
        denom = (y != IGNORE_INDEX).sum().clamp(min=1)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=h.device)
        if denom.numel() != 1:
            raise ValueError(f"linear_cross_entropy: num_items_in_batch must hold one count, got shape {tuple(denom.shape)}")
        # one count, whatever its shape (Trainer's nn.DataParallel path, which an enabled model
        # refuses, hands its replicas a (1, 1) tensor; a direct caller may hand any such shape)
        denom = denom.reshape(())
    kernel = resolve_kernel(SWITCHES["loss_kernel"].parse(kernel), h.device)
    if kernel == "cce" and torch.cuda.is_current_stream_capturing():
        kernel = "compiled"
    if kernel == "cce":
        return _cce(h, weight, y, denom)
    return _LinearCrossEntropy.apply(h, weight, y, denom, chunk, kernel)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _why_not(lm) -> str | None:
    """Why this causal LM must keep the stock loss, or None."""
    head = lm.lm_head
    if type(head) is not torch.nn.Linear:
        return f"its lm_head is a {type(head).__name__} (an adapter on lm_head needs the stock path)"
    if head.bias is not None:
        return "its lm_head has a bias"
    cfg = lm.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier"):
        if getattr(cfg, name, None):
            return f"its config sets {name}"
    if (odd := logits_beyond_lm_head(type(lm))) is not None:  # a scale or softcap under another name
        return f"its forward makes its logits more than lm_head(hidden_states): `{odd}`"
    return None


def _fused_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    stock = getattr(self, _ATTR)
    cache = past_key_values if past_key_values is not None else kwargs.pop("cache", None)
    why = _stock_reason(self, kwargs) if labels is not None and self.training else "no loss to fuse"
    if why is not None:
        if why != "no loss to fuse":  # a training call with labels that another loss served
            self.__dict__[_PATHS][why] = self.__dict__[_PATHS].get(why, 0) + 1
        if cache is not None:
            kwargs[cache_kwarg(type(self).forward)] = cache
        return stock(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                     logits_to_keep=logits_to_keep, **kwargs)
    self.__dict__[_PATHS]["fused"] = self.__dict__[_PATHS].get("fused", 0) + 1
    num_items = kwargs.pop("num_items_in_batch", None)
    shifted = kwargs.pop("shift_labels", None)
    if cache is not None:  # passed on only when given: the keyword's name moved in transformers 5.24
        kwargs[cache_kwarg(type(self.model).forward)] = cache
    out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden, device_type = out.last_hidden_state, self.lm_head.weight.device.type
    if torch.is_autocast_enabled(device_type):  # to lm_head's dtype (_stock_reason): cast as it would
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    with autocast_off(device_type):  # the loss's fp32 math stays fp32
        loss = linear_cross_entropy(hidden, self.lm_head.weight,
                                    shifted if shifted is not None else shift_labels(labels),
                                    num_items_in_batch=num_items, kernel=self.__dict__[_KERNEL])
    from transformers.modeling_outputs import CausalLMOutputWithPast

    field = output_cache_field(CausalLMOutputWithPast)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=out.hidden_states,
                                  attentions=out.attentions, **{field: out.get(output_cache_field(type(out)))})


def _stock_reason(lm, kwargs) -> str | None:
    """Why a training call with labels runs the stock forward, or None for the fused loss."""
    if "fused_lm_head" in kwargs:
        return "the caller's fused lm_head (TRL)"
    if kwargs.get("output_router_logits") or getattr(lm.config, "output_router_logits", False):
        return "router logits requested"
    w = lm.lm_head.weight
    if autocast_changes(w.device.type, w.dtype):  # Trainer's bf16=True over fp32 weights
        return f"autocast to {str(torch.get_autocast_dtype(w.device.type)).removeprefix('torch.')} over a " \
               f"{str(w.dtype).removeprefix('torch.')} lm_head (its logits' dtype is autocast's to choose)"
    return None


def enable(model, *, fused_loss: bool | None = None, loss_kernel: str | None = None, **_ignored):
    """Compute ``model(..., labels=...)``'s loss with ``linear_cross_entropy`` in training mode
    (switch ``fused_loss``, also OPTIM_FUSED_LOSS; its chunk kernel: ``loss_kernel``, also
    OPTIM_LOSS_KERNEL). Idempotent; ``fused_loss=False`` restores the stock forward. Returns the
    model."""
    on = SWITCHES["fused_loss"].resolve(fused_loss)
    kernel = SWITCHES["loss_kernel"].resolve(loss_kernel)
    lm = causal_lm(model)
    if lm is None:
        if on:
            log.info("optim.loss: %s is not a causal LM with .model and .lm_head; loss left alone",
                     type(model).__name__)
        return model
    patched = _ATTR in lm.__dict__
    if not on:
        return disable(model)
    why = None if patched else _why_not(lm)
    if why:
        log.info("optim.loss: keeping the stock loss of %s: %s", type(lm).__name__, why)
        return model
    # a later call may change the kernel; a missing cut-cross-entropy fails here, not in a step
    lm.__dict__[_KERNEL] = resolve_kernel(kernel, lm.lm_head.weight.device)
    if patched:
        return model
    lm.__dict__[_ATTR] = lm.forward  # the bound stock forward
    lm.__dict__[_PATHS] = {}
    lm.forward = types.MethodType(_fused_forward, lm)
    refuse_data_parallel(lm)
    return model


def disable(model):
    """Undo ``enable``: the causal LM's own forward and loss."""
    lm = causal_lm(model)
    if lm is not None and _ATTR in lm.__dict__:
        del lm.forward
        for attr in (_ATTR, _KERNEL, _PATHS):
            lm.__dict__.pop(attr, None)
        refuse_data_parallel(lm, on=False)
    return model


def describe(model) -> dict:
    """Whether the fused loss is in place and, from the training calls with labels so far, which
    loss they computed: ``fused_loss`` is False once every such call went to another loss (TRL's
    own fused lm_head, say), ``loss_calls`` counts each path."""
    lm = causal_lm(model)
    on = lm is not None and _ATTR in lm.__dict__
    paths = dict(lm.__dict__.get(_PATHS, {})) if on else {}
    bypassed = sorted(k for k in paths if k != "fused")
    d = {"fused_loss": on and (not paths or "fused" in paths),
         "chunk_tokens": chunk_tokens(lm.lm_head.weight.shape[0]) if on else None,
         "loss_kernel": lm.__dict__.get(_KERNEL) if on else None, "loss_calls": paths}
    if on and bypassed and "fused" not in paths:
        d["fused_loss_bypassed"] = "; ".join(bypassed)
    return d
