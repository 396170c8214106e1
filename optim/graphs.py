"""A whole training step captured once as CUDA graphs and replayed: the host leaves the step.

A LoRA step of a small model, or of a MoE model at short lengths, is host-bound on an
H100: the GPU waits between kernels while Python issues the next one, so the step takes as long
as the host needs and varies with the host CPU (``results/host-diag``: a pure-Python loop pinned
to one vCPU spreads 1.07-1.14 p80/p20 there). Replaying a captured graph issues the same kernels
with one launch per phase, so the step takes what the GPU needs.

    step = GraphedStep(lambda: loss_fn(model, static_ids, static_labels), optimizer)
    step.capture()                      # after the eager warm-up steps
    for batch in loader:
        static_ids.copy_(batch.ids); static_labels.copy_(batch.labels)
        loss = step.forward(); step.backward(); step.optimizer_step()

Three graphs, forward (with the loss), backward and optimizer, share one memory pool and replay in
that order, so a caller can time each phase between replays. What a step needs to be captured:

- every input it reads lives in tensors the caller refills in place (``copy_``) before each
  replay; anything the step computes on the host from a batch is frozen at capture;
- no host sync inside the step (``.item()``, ``nonzero``, a CUDA ``bincount``, ``print`` of a
  tensor); transformers skips its own data-dependent checks while a stream captures;
- a capturable optimizer (``torch.optim.AdamW(..., capturable=True)``): its step count lives on
  the device;
- no randomness torch's checkpoint would have to replay: no dropout with p > 0, and
  checkpointing with ``preserve_rng_state=False`` (the RNG state cannot be read during capture);
- no host copies on side streams (``optim.offload``).

The gradients become static buffers of the backward graph: replaying it overwrites them, so do
not call ``optimizer.zero_grad()`` between replays (that would free them).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable

import torch
from torch import nn

from optim.packing.checks import raise_pending
from optim.recompute import BudgetedCheckpoint

# transformers skips its data-dependent mask checks while a stream captures (``is_tracing``), so
# a captured forward can take another mask path than an eager one: with one document per row,
# eager finds no packing and builds a plain causal mask, the capture builds the packed one, and a
# compiled mask builder then compiles anew inside the capture, which fails it (Qwen3-30B-A3B at
# 1024 tokens on the H200). The warm-up before the capture takes the capture's path.
_CAPTURE_PATH_MODULES = ("transformers.masking_utils",)


class CaptureError(RuntimeError):
    """The step could not be captured; the message says what in the step prevents it."""


def check_capturable(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse, before any capture, a model or optimizer whose step a graph would replay wrongly
    (``optimizer`` None: its step is not captured)."""
    for group in optimizer.param_groups if optimizer is not None else ():
        if "capturable" in group and not group["capturable"]:
            raise CaptureError(f"{type(optimizer).__name__} was built with capturable=False; its step count "
                               "would stay on the host and freeze at capture. Build it with capturable=True")
    if model.training:
        for name, m in model.named_modules():
            if isinstance(m, nn.Dropout) and m.p > 0:
                raise CaptureError(f"{name} is a Dropout with p={m.p}: a replayed graph would repeat the "
                                   "captured random stream. Set the dropout to 0 to capture the step")
    config = getattr(model, "config", None)
    p = getattr(config, "attention_dropout", 0.0) or 0.0
    if model.training and p > 0:
        raise CaptureError(f"config.attention_dropout={p}: a replayed graph would repeat the captured random "
                           "stream. Set it to 0 to capture the step")


def check_checkpointing(model: nn.Module) -> None:
    """Refuse checkpointed layers a capture cannot take: torch's checkpoint preserving the RNG state
    (it reads the state inside the step) and ``optim.offload`` (host copies on side streams)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for name, m in model.named_modules():
        if not getattr(m, "gradient_checkpointing", False):
            continue
        fn = getattr(m, "_gradient_checkpointing_func", None)
        while isinstance(fn, BudgetedCheckpoint):  # optim.recompute's: the configured function inside
            fn = fn.__wrapped__
        if type(fn).__name__ == "Offloader":
            raise CaptureError(f"{name or 'the model'} checkpoints through optim.offload, whose host copies run on "
                               "side streams a graph cannot capture; leave optim.offload off (optim.enable does by default)")
        inner = fn.func if isinstance(fn, functools.partial) else fn
        kwargs = fn.keywords if isinstance(fn, functools.partial) else {}
        if inner is checkpoint and kwargs.get("preserve_rng_state", True):
            raise CaptureError(f"{name or 'the model'} checkpoints with preserve_rng_state=True, which reads the RNG "
                               "state inside the step; enable checkpointing with gradient_checkpointing_kwargs="
                               "{'use_reentrant': False, 'preserve_rng_state': False}")


@contextlib.contextmanager
def capture_paths():
    """Inside: transformers takes the code paths it takes while a CUDA stream captures, and
    optim.packing makes no kernel choice from host lengths (the capture has none)."""
    from optim.packing.metadata import CAPTURE_PATHS

    patched = []
    for name in _CAPTURE_PATH_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "is_tracing"):
            patched.append((mod, mod.is_tracing))
            mod.is_tracing = lambda *args, **kwargs: True
    CAPTURE_PATHS["depth"] += 1
    try:
        yield
    finally:
        CAPTURE_PATHS["depth"] -= 1
        for mod, fn in patched:
            mod.is_tracing = fn


class GraphedStep:
    """Forward + loss, backward and optimizer step of one training step, each a CUDA graph.

    ``forward_loss()`` runs the model on the caller's static input tensors and returns the
    scalar loss. ``warmup`` eager steps run on a side stream before the capture, as torch asks
    (they train the model like any other step). At least one: the first step makes the optimizer's
    state, which a capture would otherwise record, zero-fills included, and replay every step.

    The optimizer step's learning rate is the one it was captured with where it is a float (a
    kernel argument): ``optimizer_step`` refuses to replay once a group's float lr has changed (a
    scheduler's step). A learning rate built as a tensor is read by the graph at each replay.
    """

    def __init__(self, forward_loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                 *, warmup: int = 2):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"GraphedStep warmup must be an int >= 1 (the optimizer's state is made in an "
                             f"eager step, not in the capture), got {warmup!r}")
        if not torch.cuda.is_available():
            raise CaptureError("a CUDA graph needs a CUDA device; none is visible")
        self.forward_loss = forward_loss
        self.optimizer = optimizer
        self.warmup = warmup
        self.graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None
        self.loss: torch.Tensor | None = None
        self.capture_ms: float | None = None

    def capture(self) -> None:
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capture_paths():
            for _ in range(self.warmup):
                self.forward_loss().backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        raise_pending(wait=True)  # the warm-up batches' position checks, before the graph freezes one
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graphs' pool cannot use them
        self.optimizer.zero_grad(set_to_none=True)  # the backward graph allocates the grads it replays into
        fwd, bwd, opt = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        phase = "forward"
        try:
            with torch.cuda.graph(fwd):
                loss = self.forward_loss()
            phase = "backward"
            with torch.cuda.graph(bwd, pool=fwd.pool()):
                loss.backward()
            phase = "optimizer"
            with torch.cuda.graph(opt, pool=fwd.pool()):
                self.optimizer.step()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise CaptureError(
                f"the {phase} could not be captured as a CUDA graph: {str(e).splitlines()[0]}. The usual "
                "cause is a host sync inside the step (.item(), nonzero, a CUDA bincount, a data-dependent "
                "shape); see optim.graphs for what a capturable step needs") from e
        torch.cuda.synchronize()
        self.graphs = (fwd, bwd, opt)
        self._captured_lr = _float_lrs(self.optimizer)
        self.loss = loss.detach()
        self.capture_ms = (time.perf_counter() - t0) * 1e3

    def _graph(self, i: int) -> torch.cuda.CUDAGraph:
        if self.graphs is None:
            raise RuntimeError("GraphedStep.capture() has not run")
        return self.graphs[i]

    def forward(self) -> torch.Tensor:
        """Replay forward + loss; returns the static loss tensor (overwritten by the next replay)."""
        self._graph(0).replay()
        return self.loss

    def backward(self) -> None:
        self._graph(1).replay()

    def optimizer_step(self) -> None:
        graph = self._graph(2)
        if _float_lrs(self.optimizer) != self._captured_lr:
            raise CaptureError("the optimizer's learning rate changed after the capture, and a float lr is "
                               "fixed in the captured step: build the optimizer with lr=torch.tensor(lr, "
                               "device='cuda') so a scheduler's changes reach the graph")
        graph.replay()


def _float_lrs(optimizer: torch.optim.Optimizer) -> list:
    """Each param group's lr where it is a plain number (None where a tensor: read at replay)."""
    return [None if isinstance(g.get("lr"), torch.Tensor) else g.get("lr") for g in optimizer.param_groups]
