"""``GraphedTrainer``: ``transformers.Trainer`` with each micro-step's forward + loss + backward
replayed as one CUDA graph.

    import optim
    from optim.trainer import GraphedTrainer

    model = optim.enable(get_peft_model(model, lora_config))
    args = TrainingArguments(..., bf16=True, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    trainer = GraphedTrainer(model=model, args=args, train_dataset=docs,
                             data_collator=optim.packing.PackingCollator(max_length=8192, rows=1))
    trainer.train()

The first ``graph_warmup_steps`` micro-steps run eagerly (compilation, allocator warm-up); then the
forward + loss + backward is captured once, on static copies of the batch, and every later
micro-step copies its batch in and replays it. The optimizer, the LR scheduler, gradient clipping
and gradient accumulation stay Trainer's own, eager: after each replay the step's gradients are
added into ``param.grad`` (copied at the start of an accumulation cycle, when Trainer's
``zero_grad`` left them ``None``). The loss's normalisation (``num_items_in_batch``) and the
accumulation scale are device tensors refilled per micro-step, so they are not frozen.

Packed batches replay one graph whatever their document lengths: the batch's ``packing`` host
metadata is not handed to the model; the capture reads the boundaries from the static
``position_ids`` on the device (``optim.packing``, flex or sdpa backend; varlen needs the lengths
on the host and is refused).

With Trainer's defaults the host does not wait for each replay: Trainer's
``logging_nan_inf_filter`` (on by default) tests each micro-step's loss on the host, a sync per
micro-step; here the same filter runs on the device (a non-finite loss is replaced by the running
mean Trainer would add), and Trainer's test of the already-finite loss is skipped for that
micro-step. Batches are copied to the device without a sync (accelerate's ``non_blocking``, set
where the loader pins memory, as Trainer's does by default), so the host prepares the next step
while the GPU replays this one. What still syncs is Trainer's own: each log (``logging_steps``),
``include_num_input_tokens_seen``, a tensor learning rate.

Supported: one CUDA device; bf16 or fp32 (not fp16's loss scaler); every batch the same tensor
shapes (pad rows to a fixed length); no dropout; checkpointing without RNG-state preservation;
``compute_loss`` without host syncs. Anything else raises ``CaptureError`` with the reason,
before or at the capture; nothing is silently run eagerly.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from optim.graphs import (
    CaptureError,
    capture_paths,
    check_capturable,
    check_checkpointing,
)
from optim.packing.checks import raise_pending

# batch keys that are host-side descriptions of the batch, dropped so the capture reads the device
_HOST_ONLY = ("packing",)


class GraphedTrainer(Trainer):
    """``transformers.Trainer`` whose micro-steps replay one captured CUDA graph (see the module)."""

    def __init__(self, *args, graph_warmup_steps: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        if graph_warmup_steps < 1:
            raise ValueError("graph_warmup_steps must be >= 1 (the capture needs the eager steps before it)")
        self.graph_warmup_steps = graph_warmup_steps
        self._graph: torch.cuda.CUDAGraph | None = None
        self._eager_steps = 0
        self._static: dict[str, torch.Tensor] = {}
        self._filter_skipped = False  # logging_nan_inf_filter turned off for one micro-step's host test
        self._check_args()

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator (made at init, and again by a hyperparameter search), whose train
        loader copies pinned batches with ``non_blocking``: in stream order, no sync per tensor."""
        super().create_accelerator_and_postprocess()
        config = getattr(self.accelerator, "dataloader_config", None)
        if config is not None and self.args.dataloader_pin_memory:
            config.non_blocking = True

    def _check_args(self) -> None:
        a = self.args
        if not torch.cuda.is_available():
            raise CaptureError("GraphedTrainer replays CUDA graphs; no CUDA device is visible")
        if a.fp16:
            raise CaptureError("fp16 training scales the loss with a host-side GradScaler; use bf16=True")
        if a.n_gpu > 1 or a.world_size > 1:
            raise CaptureError("GraphedTrainer captures one device's step; it does not run data- or model-parallel")
        if a.gradient_checkpointing and (a.gradient_checkpointing_kwargs or {}).get("preserve_rng_state", True):
            raise CaptureError("checkpointing that preserves the RNG state reads it inside the step; pass "
                               "gradient_checkpointing_kwargs={'use_reentrant': False, 'preserve_rng_state': False}")

    # -----------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._restore_filter()  # where no floating_point_ops call came between (a subclass's own)
        if self._graph is None and self._eager_steps < self.graph_warmup_steps:
            self._eager_steps += 1
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._device_inputs(self._prepare_inputs(inputs))
        if self._graph is None:
            if any(p.grad is not None for p in self._trainable(model)):
                # capture at the start of an accumulation cycle, so no partial sum is in flight
                self._eager_steps += 1
                return super().training_step(model, inputs, num_items_in_batch)
            self._capture(model, inputs, num_items_in_batch)
        self._fill(inputs, num_items_in_batch)
        self._graph.replay()
        self._accumulate(model)
        return self._filtered(self._loss.detach().clone())

    def _filtered(self, loss: torch.Tensor) -> torch.Tensor:
        """Trainer's ``logging_nan_inf_filter`` on the device: a non-finite loss becomes what
        Trainer would add in its place (the running loss over the steps since the last log), and
        Trainer's host test, which would wait for the replay, is off until ``floating_point_ops``,
        which Trainer calls next. Where Trainer keeps no ``_tr_loss`` (another version), its own
        test runs."""
        running = getattr(self, "_tr_loss", None)
        if not self.args.logging_nan_inf_filter or not isinstance(running, torch.Tensor):
            return loss
        since = 1 + self.state.global_step - getattr(self, "_globalstep_last_logged", self.state.global_step)
        loss = torch.where(torch.isfinite(loss), loss, running / since)
        self.args.logging_nan_inf_filter, self._filter_skipped = False, True
        return loss

    def _restore_filter(self) -> None:
        if self._filter_skipped:
            self.args.logging_nan_inf_filter, self._filter_skipped = True, False

    def floating_point_ops(self, inputs):
        self._restore_filter()  # Trainer calls this right after its filter's test
        return super().floating_point_ops(inputs)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._restore_filter()

    @staticmethod
    def _device_inputs(inputs: dict) -> dict:
        """The batch as the graph takes it: tensors only. Host metadata (``packing=``) cannot be
        refilled into a graph, so the documents travel as the position_ids it gives (restarting at
        each document); a batch with both keeps its own position_ids (checked against it eagerly)."""
        out = {k: v for k, v in inputs.items() if k not in _HOST_ONLY}
        meta = inputs.get("packing")
        if meta is not None and out.get("position_ids") is None:
            ids = out.get("input_ids")
            out["position_ids"] = meta.position_ids().to(ids.device if isinstance(ids, torch.Tensor) else "cpu",
                                                         non_blocking=True)
        return out

    @staticmethod
    def _trainable(model) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def _scale(self, num_items_in_batch) -> float:
        """What Trainer divides the loss by before the backward (1 where the loss is already
        normalised over the accumulated batch)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5.2x
        if scaled is None:
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or \
                getattr(self, "compute_loss_func", None) is not None
        steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return 1.0 if scaled else 1.0 / steps

    def _fill(self, inputs: dict, num_items_in_batch) -> None:
        if set(inputs) != set(self._static_inputs):
            raise CaptureError(f"the batch's keys {sorted(inputs)} differ from the captured {sorted(self._static_inputs)}")
        for k, v in inputs.items():
            buf = self._static_inputs[k]
            if not isinstance(v, torch.Tensor) or v.shape != buf.shape or v.dtype != buf.dtype:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise CaptureError(f"batch[{k!r}] is {got}, but the graph was captured for {tuple(buf.shape)} "
                                   f"{buf.dtype}: pad every batch to one shape (PackingCollator pads rows to "
                                   "max_length)")
            buf.copy_(v, non_blocking=True)
        if (num_items_in_batch is None) != (self._static_items is None):
            raise CaptureError("num_items_in_batch was given at capture and not now, or the reverse")
        if isinstance(num_items_in_batch, torch.Tensor):
            self._static_items.copy_(num_items_in_batch.reshape(()), non_blocking=True)
        elif num_items_in_batch is not None:
            self._static_items.fill_(num_items_in_batch)
        self._static_scale.fill_(self._scale(num_items_in_batch))

    def _capture(self, model, inputs: dict, num_items_in_batch) -> None:
        check_capturable(model, None)
        check_checkpointing(model)
        bad = {k: type(v).__name__ for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
        if bad:
            raise CaptureError(f"batch entries {bad} are not tensors: a graph can only refill tensors")
        device = next(iter(inputs.values())).device
        self._static_inputs = {k: v.clone() for k, v in inputs.items()}
        self._static_items = (None if num_items_in_batch is None else
                              torch.zeros((), device=device, dtype=torch.float32))
        self._static_scale = torch.ones((), device=device, dtype=torch.float32)
        self._fill(inputs, num_items_in_batch)
        params = self._trainable(model)

        def forward_backward():
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, dict(self._static_inputs), num_items_in_batch=self._static_items)
            loss = loss * self._static_scale
            loss.backward()
            return loss

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capture_paths():
            forward_backward()  # one eager pass on a side stream, as torch asks before a capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        raise_pending(wait=True)  # the warm-up batches' position checks, before the graph freezes one
        for p in params:
            p.grad = None  # the graph allocates the gradients it replays into
        # the eager pass's cached blocks (its gradients included) go back to the device: the graph's
        # pool cannot use them, and optim.recompute's decision for the captured step (that pass's)
        # counted them as free
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                loss = forward_backward()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            raise CaptureError(f"the training step could not be captured as a CUDA graph: {str(e).splitlines()[0]}. "
                               "The usual cause is a host sync inside compute_loss or the model (.item(), "
                               "nonzero, a data-dependent shape); see optim.graphs") from e
        self._graph, self._loss = graph, loss
        self._graph_params = params
        self._graph_grads = [p.grad for p in params]
        self._accum = [torch.empty_like(g) if g is not None else None for g in self._graph_grads]
        for p in params:
            p.grad = None

    def _accumulate(self, model) -> None:
        params = self._trainable(model)
        if len(params) != len(self._graph_params) or any(a is not b for a, b in zip(params, self._graph_params)):
            # each captured gradient belongs to one parameter: another trainable set (requires_grad
            # changed, set_adapter, a new model) would hand gradients to the wrong parameters
            raise CaptureError("the trainable parameters changed after the step was captured (requires_grad, "
                               "set_adapter, model_init); build a new GraphedTrainer for the new set")
        fresh, summed = [], []
        for p, g, acc in zip(params, self._graph_grads, self._accum):
            if g is not None:
                # None: a new accumulation cycle (Trainer's zero_grad set it to None)
                (fresh if p.grad is None else summed).append((p, g, acc))
        if fresh:  # foreach: few launches for same-dtype gradients, where a loop makes one each
            torch._foreach_copy_([acc for _, _, acc in fresh], [g for _, g, _ in fresh])
            for p, _, acc in fresh:
                p.grad = acc
        if summed:
            torch._foreach_add_([p.grad for p, _, _ in summed], [g for _, g, _ in summed])
