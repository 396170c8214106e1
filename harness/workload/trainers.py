"""One training run through ``transformers.Trainer`` or TRL's ``SFTTrainer``, stock or with
``optim.enable`` (or ``optim.trainer.GraphedTrainer``), on generated documents, returning its
per-step losses and step times. ``harness.bench.trainer`` runs them side by side and stores rows;
the Trainer/TRL tests run them on CPU and GPU.

The order ``SFTTrainer(peft_config=...)`` needs: build the trainer (it wraps the model in peft),
then ``optim.enable(trainer.model)``, then ``trainer.train()`` (which builds the optimizer)."""

from __future__ import annotations

import statistics
import time

import torch

from harness.workload import models


def tokenizer(vocab_size: int):
    """A word-level tokenizer over ``t0..t{V-1}`` (nothing downloaded); TRL wants one."""
    from tokenizers import Tokenizer
    from tokenizers import models as tm
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tm.WordLevel(words, unk_token="t0")),
                                   pad_token="t0", eos_token="t1")


def documents(n: int, vocab_size: int, lo: int, hi: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(2, vocab_size, (k,), generator=g).tolist()} for k in lens]


class StepTimer:
    """A TrainerCallback timing each optimizer step with CUDA events (wall clock on CPU); read
    once training ends, so timing adds no sync to the loop. It also keeps each step's host time,
    from its begin to its end callback (``issue_ms``): where a step is host-bound, or waits on a
    sync, the step time follows it; where the GPU is the limit and nothing in the step waits for
    it, it is shorter. And Python's cycle collections within each step, by generation
    (``collections``): the pauses a host-bound step pays where the collector runs."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self
        self.marks: list = []
        self.host: list = []
        self.gc: list = []

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.gc.append([_collections(), None])
                timer.host.append([time.perf_counter(), None])
                timer.marks.append([timer._mark(), None])

            def on_step_end(self, args, state, control, **kw):
                timer.marks[-1][1] = timer._mark()
                timer.host[-1][1] = time.perf_counter()
                timer.gc[-1][1] = _collections()

        self.callback = _Callback()

    @staticmethod
    def _mark():
        if torch.cuda.is_available():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self) -> list[float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]

    def issue_ms(self) -> list[float]:
        """Each step's host time, from its begin callback to its end callback, in ms."""
        return [(b - a) * 1e3 for a, b in self.host]

    def collections(self) -> list[list[int]]:
        """Each step's cycle collections, from its begin callback to its end callback, by generation."""
        return [[y - x for x, y in zip(a, b)] for a, b in self.gc]


def _collections() -> list[int]:
    import gc

    return [g["collections"] for g in gc.get_stats()]


class StepLosses:
    """Each optimizer step's loss as Trainer logs it (the sum of its micro-steps' ``training_step``
    returns), kept on the device and read once training ends. Logging every step to read them
    would add the log's own host syncs to every step (Trainer reads the loss and the gradient norm
    with ``.item()`` at each log), which a user with Trainer's default ``logging_steps`` does not
    pay. (Trainer's default ``logging_nan_inf_filter`` still tests each micro-step's loss on the
    host, a sync a user pays too; GraphedTrainer's replayed micro-steps test it on the device.)"""

    def __init__(self):
        from transformers import TrainerCallback

        rec = self
        self.micro: list = []
        self.bounds: list[int] = []

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                rec.bounds.append(len(rec.micro))

        self.callback = _Callback()

    def attach(self, trainer) -> None:
        """Wrap this trainer's ``training_step`` (bound on the instance) and add the callback."""
        step = trainer.training_step

        def training_step(*args, **kwargs):
            loss = step(*args, **kwargs)
            self.micro.append(loss.detach().clone())  # never a view Trainer adds into
            return loss

        trainer.training_step = training_step
        trainer.add_callback(self.callback)

    def losses(self) -> list[float]:
        """Per optimizer step; under torch.distributed the mean over ranks, as Trainer logs it (a
        collective: every rank calls it)."""
        sums, start = [], 0
        for end in self.bounds:
            part = self.micro[start:end]
            sums.append(torch.stack(part).sum() if part else torch.tensor(float("nan")))
            start = end
        if not sums:
            return []
        device = self.micro[0].device if self.micro else "cpu"
        per_step = torch.stack([x.to(device, torch.float32) for x in sums])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(per_step, op=dist.ReduceOp.SUM)
            per_step /= dist.get_world_size()
        return per_step.tolist()


class UnslothFlattening:
    """What Unsloth's padding-free collator hands its model: the stock flattened row
    (``DataCollatorWithFlattening``: position_ids restarting per document, each document's first
    label masked) plus each document's length as ``packed_seq_lengths`` (host int32); Trainer moves
    it to the device with the batch. Unsloth's own attention (the families it rewrites: Llama,
    Qwen3) reads the lengths to keep to each document. Where the model runs transformers' own code
    (qwen3_moe), a plain Trainer leaves the key unread (Unsloth's SFTTrainer installs its packed
    attention) and transformers' mask keeps to each document from the position ids. On gpt-oss,
    Unsloth's flex attention with sinks reads neither: a row's later document attends to the
    earlier one, as stock transformers' gpt-oss mask does (Unsloth's SFTTrainer turns padding-free
    off for gpt-oss and trains a document per row)."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_position_ids=True)

    def __call__(self, features: list[dict]) -> dict:
        from harness.run import unsloth_stack

        batch = self.flatten(features)
        batch.update(unsloth_stack.lengths_kwargs([len(f["input_ids"]) for f in features]))
        return batch


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


def _summary(trainer, timer: StepTimer, warmup: int, losses: StepLosses | None = None) -> dict:
    ms = timer.ms()[warmup:]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    logged = _losses(trainer)
    return {"losses": losses.losses() if losses is not None else logged, "logged_losses": logged,
            "step_ms": statistics.median(ms) if ms else None, "step_ms_all": timer.ms(),
            "issue_ms_all": timer.issue_ms(), "gc_collections_all": timer.collections(), "peak_gib": peak}


def _one_device(args, data_parallel: bool):
    """Trainer wraps the model in nn.DataParallel when it sees several GPUs and no launcher. These
    runs measure one device's step, so they keep to the first GPU (as Trainer itself does for a
    model-parallel model) unless ``data_parallel`` asks for Trainer's own multi-GPU default."""
    if not data_parallel and args.n_gpu > 1:
        args._n_gpu = 1
    return args


def sft_run(model_name: str, *, ours: bool, mode: str, steps: int, batch_size: int, docs: list[dict],
            device: str = "cpu", dtype=torch.float32, max_length: int | None = None, lora_rank: int = 4,
            out_dir: str, warmup: int = 0, data_parallel: bool = False, **settings) -> dict:
    """TRL SFTTrainer on a bare model with ``peft_config``: ``mode`` "padding_free" (TRL's
    flattened batches with cu_seq_lens) or "packing" (TRL's BFD packing, position_ids per row)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import optim

    spec = models.get(model_name)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    model = models.build(spec, device=device, dtype=dtype, lora_rank=None)
    kw = dict(padding_free=True, max_length=None) if mode == "padding_free" else \
        dict(packing=True, packing_strategy="bfd", max_length=max_length)
    args = SFTConfig(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                     learning_rate=1e-4, use_cpu=device == "cpu", report_to=[], save_strategy="no",
                     logging_steps=1, bf16=dtype == torch.bfloat16, disable_tqdm=True, seed=0,
                     dataloader_num_workers=0, **kw)
    _one_device(args, data_parallel)
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(docs),
                         processing_class=tokenizer(spec.vocab_size), callbacks=[timer.callback],
                         peft_config=LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"))
    if ours:
        optim.enable(trainer.model, **settings)  # after SFTTrainer wraps it in peft, before train()
    from optim import packing

    packing.reset_counters()
    trainer.train()
    return {**_summary(trainer, timer, warmup), "counters": packing.counters(), "kernels": packing.kernels(),
            "enabled": optim.enabled(trainer.model), "n_gpu": trainer.args.n_gpu}


def _profiler(profile: dict | None) -> list:
    """The callback that profiles ``profile``'s steps (``trainer_run``'s argument), or none."""
    if not profile:
        return []
    from pathlib import Path

    from harness.run.profile import trainer_host_profiler, trainer_profiler

    if profile.get("host"):  # cProfile of the host side, not torch.profiler
        return [trainer_host_profiler(Path(profile["out_dir"]), profile["stem"], start=profile["start"],
                                      steps=profile["steps"], summary=profile["summary"])]
    return [trainer_profiler(Path(profile["out_dir"]), profile["stem"], start=profile["start"],
                             steps=profile["steps"], summary=profile["summary"], trace=profile.get("trace", False))]


def stock_weights(spec, *, device, dtype):
    """A function that builds stock's bare model as ``trainer_run`` does (seed 0, on ``device``, whose
    generator draws the weights), for Unsloth's loader to read (``unsloth_stack.build(base=...)``)."""
    return lambda: models.build(spec, device=device, dtype=dtype, lora_rank=None, gradient_checkpointing=False)


def unsloth_weights(spec, *, device, dtype, weights_dir: str | None = None) -> tuple:
    """What Unsloth's loader is handed, and the row's ``weights``: stock's base weights
    (``stock_weights``) and ``"stock"``, so Unsloth trains the model stock trains (its adapters are
    its own draw, lora_B at zero: the first step's loss is stock's model, the later ones part by
    the adapters' draw); or, where the disk has no room for them, nothing (Unsloth draws its own)
    and why. ``weights_dir``: a folder the Unsloth runs of one bench share, where the first saves
    stock's weights and the later ones read them (``unsloth_stack.saved_weights``); else each run
    saves its own copy in the temporary directory."""
    from pathlib import Path

    from harness.run import unsloth_stack

    shared = Path(weights_dir) / spec.name if weights_dir is not None else None
    if shared is not None and shared.is_dir():  # an earlier run of the bench saved them
        return shared, "stock"
    if shared is not None:
        unsloth_stack.drop_unfinished(spec, shared.parent)  # a killed run's half save: its room is ours
    why = unsloth_stack.no_room_for_weights(spec, dtype, weights_dir)
    if why is None:
        base = stock_weights(spec, device=device, dtype=dtype)
        if shared is not None:
            base = unsloth_stack.saved_weights(spec, shared.parent, base)
        return base, "stock"
    print(f"Unsloth draws its own random weights: {why}", flush=True)
    return None, f"Unsloth's own draw: {why}"


def _after_handover() -> None:
    """The card's peak counted from here: stock's model, built and saved for Unsloth's loader in a
    bench's first Unsloth run (``unsloth_weights`` with a shared folder), is the harness's handover,
    not Unsloth's memory, and the later runs, which only read the folder, do not build it."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# the training recipe every Trainer run here shares: the same schedule, clipping and seed
RECIPE = dict(learning_rate=1e-4, max_grad_norm=1.0, lr_scheduler_type="linear", seed=0, report_to=[],
              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
# TrainingArguments fields whose defaults Unsloth's SFTConfig changes, kept at TrainingArguments' own
SAME_AS_TRAINER = ("optim", "weight_decay", "warmup_steps", "logging_nan_inf_filter", "torch_empty_cache_steps",
                   "logging_steps")


def unsloth_sft_run(model_name: str, *, steps: int, batch_size: int, docs: list[dict], max_length: int,
                    device: str = "cuda", dtype=torch.bfloat16, lora_rank: int = 16, out_dir: str, warmup: int = 0,
                    gradient_checkpointing: bool = True, logging_steps: int | None = None,
                    trainer_args: dict | None = None, callbacks: list | None = None,
                    profile: dict | None = None, weights_dir: str | None = None) -> dict:
    """What an Unsloth user runs: TRL's ``SFTTrainer`` (which Unsloth, imported first, patches) on
    the model from ``FastLanguageModel`` (``harness.run.unsloth_stack.build``) with stock's base
    weights where the disk has room (``unsloth_weights``), the documents
    pre-tokenized, every batching choice left to Unsloth: padding-free where it turns that on by
    itself (the document lengths to its attention), a document per padded row where it does not
    (gpt-oss, whose attention would cross documents). ``max_length`` None in the config, as TRL
    asks of padding-free with inputs already cut to length (each document is); the model's
    window is ``max_length``. Trainer's own checkpointing stays off: Unsloth's is the model's.
    Unsloth's ``SFTConfig`` has defaults of its own (two accumulated micro-steps, 8-bit AdamW, a
    warm-up, weight decay, no NaN/Inf filter); the training ones the other runs leave to
    ``TrainingArguments`` are set to its defaults here (``SAME_AS_TRAINER``), so each optimizer
    step trains the same tokens with the same optimizer. The process must have imported Unsloth
    first (``python -m harness _trainer_run`` does); PeerUnavailable where it cannot run here.
    ``batching`` says what Unsloth chose; ``profile`` and ``weights_dir`` as ``trainer_run``'s."""
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from harness.run import unsloth_stack

    spec = models.get(model_name)
    unsloth_stack.check(spec, device=torch.device(device), lora_rank=lora_rank, max_seq_length=max_length)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base, weights = unsloth_weights(spec, device=device, dtype=dtype, weights_dir=weights_dir)
    _after_handover()
    model = unsloth_stack.build(spec, device=torch.device(device), dtype=dtype, lora_rank=lora_rank,
                                max_seq_length=max_length, gradient_checkpointing=gradient_checkpointing, seed=0,
                                base=base)
    extra = dict(trainer_args or {})
    clash = sorted(set(extra) & {"logging_steps", "output_dir", "max_steps", "gradient_checkpointing"})
    if clash:
        raise ValueError(f"trainer_args {clash} are set by unsloth_sft_run's own arguments")
    fields = TrainingArguments.__dataclass_fields__
    kw = {k: fields[k].default for k in SAME_AS_TRAINER}
    kw.update(RECIPE, output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch_size,
              bf16=dtype == torch.bfloat16, max_length=None, gradient_checkpointing=False,
              gradient_accumulation_steps=1)
    if logging_steps is not None:
        kw["logging_steps"] = logging_steps
    args = SFTConfig(**{**kw, **extra})
    _one_device(args, False)
    timer = StepTimer()
    checkpointing: list[bool] = []

    class _Checkpointing(TrainerCallback):  # read while training: Unsloth's train() ends in for_inference()
        def on_step_end(self, args, state, control, model=None, **kw):
            checkpointing.append(bool(getattr(model, "is_gradient_checkpointing", False)))

    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer(spec.vocab_size),
                         train_dataset=Dataset.from_list([{"input_ids": d["input_ids"]} for d in docs]),
                         callbacks=[timer.callback, _Checkpointing(), *(callbacks or []), *_profiler(profile)])
    losses = StepLosses()
    losses.attach(trainer)
    trainer.train()
    batching = "packing" if trainer.args.packing else "padding-free" if trainer.args.padding_free else "padded rows"
    return {**_summary(trainer, timer, warmup, losses), "logging_steps": args.logging_steps, "batching": batching,
            "weights": weights,
            "gradient_checkpointing": any(checkpointing),
            "attn_implementation_used": getattr(model.config, "_attn_implementation", None)}


def trainer_run(model_name: str, *, ours: bool, steps: int, batch_size: int, docs: list[dict], max_length: int,
                device: str = "cpu", dtype=torch.float32, lora_rank: int = 4, out_dir: str, warmup: int = 0,
                graphed: bool = False, rows: int | None = None, accumulation: int = 1,
                attn_implementation: str = "sdpa", experts_implementation: str | None = None,
                data_parallel: bool = False, peer: str | None = None, logging_steps: int | None = None,
                trainer_args: dict | None = None, profile: dict | None = None, gradient_checkpointing: bool = True,
                callbacks: list | None = None, weights_dir: str | None = None, **settings) -> dict:
    """transformers.Trainer on a peft model: ours with optim.packing's PackingCollator (rows of
    ``max_length`` packed tokens), stock with transformers' DataCollatorWithFlattening (one
    flattened row): the same documents per step, so the same loss.

    ``peer`` (stock only) is what a Trainer user runs instead of optim: ``"compiled"``, every
    decoder layer ``torch.compile``'d after peft (``harness.run.peers.compile_layers``),
    ``"liger"``, ``TrainingArguments(use_liger_kernel=True)``, or ``"unsloth"``, the model from
    Unsloth's ``FastLanguageModel`` with its LoRA and its own checkpointing (offloaded; Trainer's
    is left off, as Unsloth's examples leave it), fed the stock flattened row plus the document
    lengths Unsloth's padding-free collator adds (``UnslothFlattening``, which says where its
    attention reads them); the process must have imported Unsloth first (``python -m harness
    _trainer_run`` does), and its loader reads stock's base weights where the disk has room
    (``unsloth_weights``). Liger's patches for a family are partly module-wide (its RoPE function,
    its RMSNorm class), so a process that ran it runs later models of that family with them. Each
    raises ``harness.run.peers.PeerUnavailable`` where it cannot run here.
    ``gradient_checkpointing`` False runs without it (a peer whose model fits).

    ``losses`` are each optimizer step's, read without logging every step (``StepLosses``);
    ``logging_steps`` None keeps Trainer's default (a log, and its syncs, every 500 steps), as a
    user who sets none runs; ``logged_losses`` are those Trainer logged. ``trainer_args`` are more
    ``TrainingArguments`` (``{"logging_nan_inf_filter": False}``: no host read of each micro-step's
    loss), over the run's own. ``profile`` is ``harness.run.profile.trainer_profiler``'s arguments
    (``out_dir``, ``stem``, ``start``, ``steps``, ``summary``, ``trace``): those steps are profiled.
    ``callbacks`` are more ``TrainerCallback``s, after the run's own. ``weights_dir``: the folder
    the Unsloth runs of one bench share stock's saved weights in (``unsloth_weights``)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    import optim
    from optim import packing, recompute

    from harness.run import peers, unsloth_stack

    if peer not in (None, "compiled", "liger", "unsloth") or (peer and ours):
        raise ValueError(f"peer must be 'compiled', 'liger' or 'unsloth' on the stock Trainer, got {peer!r} "
                         f"(ours={ours})")
    spec = models.get(model_name)
    if peer == "liger":
        peers.liger_patch(torch.device(device))  # PeerUnavailable off CUDA or without Liger-Kernel
        peers.liger_supports(spec.config().model_type)  # or for a family it has no patches for
    if peer == "unsloth":  # PeerUnavailable off CUDA, without Unsloth, or past the shape's positions
        unsloth_stack.check(spec, device=torch.device(device), lora_rank=lora_rank, max_seq_length=max_length)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if peer == "unsloth":
        base, weights = unsloth_weights(spec, device=device, dtype=dtype, weights_dir=weights_dir)
        _after_handover()
        model = unsloth_stack.build(spec, device=torch.device(device), dtype=dtype, lora_rank=lora_rank,
                                    max_seq_length=max_length, gradient_checkpointing=gradient_checkpointing, seed=0,
                                    base=base)
    else:
        weights = "stock"
        model = models.build(spec, device=device, dtype=dtype, lora_rank=lora_rank, gradient_checkpointing=False,
                             attn_implementation=attn_implementation, experts_implementation=experts_implementation)
    if peer == "compiled":
        peers.compile_layers(model)
    if ours:
        optim.enable(model, **settings)
        collator = packing.PackingCollator(max_length=max_length, rows=rows)
    elif peer == "unsloth":
        collator = UnslothFlattening()
    else:
        collator = DataCollatorWithFlattening(return_position_ids=True)
    extra = dict(trainer_args or {})
    clash = sorted(set(extra) & {"logging_steps", "use_liger_kernel", "output_dir", "max_steps",
                                 "gradient_checkpointing"})
    if clash:
        raise ValueError(f"trainer_args {clash} are set by trainer_run's own arguments")
    kw = dict(RECIPE, output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch_size,
              use_cpu=device == "cpu", bf16=dtype == torch.bfloat16,
              # Unsloth's checkpointing is its model's own (build): Trainer's would replace it
              gradient_checkpointing=gradient_checkpointing and peer != "unsloth", remove_unused_columns=False,
              # a captured step cannot read the RNG state; the eager twin runs the same
              gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False},
              gradient_accumulation_steps=accumulation,
              use_liger_kernel=peer == "liger")
    if logging_steps is not None:
        kw["logging_steps"] = logging_steps
    args = TrainingArguments(**{**kw, **extra})
    _one_device(args, data_parallel)
    timer = StepTimer()
    cls = Trainer
    if graphed:
        from optim.trainer import GraphedTrainer as cls
    callbacks = [timer.callback, *(callbacks or []), *_profiler(profile)]
    trainer = cls(model=model, args=args, train_dataset=docs, data_collator=collator, callbacks=callbacks)
    losses = StepLosses()
    losses.attach(trainer)
    packing.reset_counters()
    trainer.train()
    return {**_summary(trainer, timer, warmup, losses), "logging_steps": args.logging_steps,
            "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
            "trainer_args": {k: getattr(args, k) for k in extra}, "counters": packing.counters(), "kernels": packing.kernels(),
            "enabled": optim.enabled(model), "n_gpu": trainer.args.n_gpu,
            "recompute_stats": recompute.describe(model) or None,
            "wrapped": type(trainer.model_wrapped).__name__,  # the name: the result keeps no model alive
            "weights": weights,  # "stock": stock's base weights, Unsloth's loader's too (unsloth_weights)
            # the attention the model ran, which Unsloth's loader chooses for itself
            "attn_implementation_used": getattr(model.config, "_attn_implementation", None)}
