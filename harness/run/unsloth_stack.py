"""The Unsloth peer (``stack = "unsloth"``): the model built the way Unsloth's own documentation
builds it, so the point measures what an Unsloth user gets.

- ``import unsloth`` comes first in the point's process, before torch, transformers and peft,
  which it patches (``import_first``, called by the point's process entry, ``harness._point``).
  The Hub is set offline for that process: Unsloth otherwise probes the network at import.
- The model comes from ``FastLanguageModel.from_pretrained`` on a local directory that holds the
  registry shape's ``config.json``, a small tokenizer and one tensor; transformers initializes
  every missing weight at load, so the weights are random, as every harness point's are (or, with
  ``base``, another stack's bare model saved there, so both train from the very same weights).
- ``max_seq_length`` is the point's length. Past the model's ``max_position_embeddings`` Unsloth
  puts linear RoPE scaling on the model (a different model from the other stacks'), so such a point
  is refused; llama3 RoPE (Llama 3.1) it keeps, only widening the window, as the other stacks run
  it past its positions: that point runs. A load whose RoPE differs from the shape's config is an
  error.
- ``FastLanguageModel.get_peft_model(..., use_gradient_checkpointing="unsloth")``: its LoRA on
  the same projections and rank as the harness's peft build, its own checkpointing (which
  offloads the checkpoints to host memory), then ``FastLanguageModel.for_training``.
- Packed rows go in as its packing collator hands them over: ``position_ids`` restarting per
  document and ``packed_seq_lengths`` (host int32), which send its attention per document.

- On MoE models Unsloth puts the experts' LoRA on the fused ``gate_up_proj`` / ``down_proj``
  through peft's ``target_parameters``, as the harness's build does. After the build, its trainable
  shapes are checked against the harness's peft build of the same shape and rank (made on the meta
  device); where they differ, the point is refused: it would train other weights.

Unsloth is an optional extra (``pip install '.[unsloth]'``). Where it is not installed, cannot import
here, or would not train what the stacks beside it train (other adapters, several rows a step),
the point's row is ``skipped`` and says why. Its points always run in a fresh interpreter (the
process launcher), and on one GPU.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from harness.run.peers import PeerUnavailable

# why ``import unsloth`` failed in this process (None: it imported, or was never tried)
IMPORT_ERROR: str | None = None
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
INSTALL = "pip install '.[unsloth]'"


def import_first() -> None:
    """Import Unsloth before anything it patches; keep a failure for the build to report."""
    global IMPORT_ERROR
    for var in OFFLINE:
        os.environ.setdefault(var, "1")
    try:
        import unsloth  # noqa: F401
    except ModuleNotFoundError as e:
        IMPORT_ERROR = f"it is not installed ({e}); install the extra: {INSTALL}"
    except Exception as e:  # noqa: BLE001 - no GPU, an incompatible torch or transformers: a skipped row
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        IMPORT_ERROR = f"importing it failed: {type(e).__name__}: {first}"


def _target_modules(spec) -> list[str]:
    """The projections the harness's peft build adapts (``models.lora_config``), as Unsloth names them."""
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return attn + (["gate_up_proj", "down_proj"] if spec.is_moe else ["gate_proj", "up_proj", "down_proj"])


def _model_dir(spec, root: Path, base=None) -> Path:
    """A local model directory: the shape's config, a four-word tokenizer, and one weight (the rest
    drawn at load), or ``base``'s weights where a bare transformers model is given. ``base`` may
    also be a function that builds one: that model is saved and released here, so the card never
    holds it and Unsloth's copy at once (a 20B model's two copies fill an 80 GB card)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if base is not None:
        model = base if isinstance(base, torch.nn.Module) else base()
        # its config and every weight (tied ones once), in shards the host holds one at a time
        model.save_pretrained(root, max_shard_size="2GB")
        if model is not base:
            del model
            gc.collect()  # a module graph can hold cycles: freed now, not at the collector's leisure
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    else:
        config = spec.config()
        config.save_pretrained(root)
        save_file({"model.norm.weight": torch.ones(config.hidden_size)}, str(root / "model.safetensors"))
    words = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(root)
    return root


def loader_dir(spec, root: Path, base) -> Path:
    """The folder Unsloth's loader reads: ``base`` where it is one ``saved_weights`` wrote, else
    ``_model_dir``'s, written under ``root``."""
    return base if isinstance(base, Path) else _model_dir(spec, root, base)


def saved_weights(spec, directory: Path, base) -> Path:
    """``base`` (a bare model, or a function that builds one) saved as Unsloth's loader reads it
    (``_model_dir``) in ``directory/<name>``, for every later run given ``directory`` to read
    without building ``base`` at all (a 20B model's weights take about a minute to build and
    write). It is saved into a folder of its own and renamed into place whole, so a run killed
    halfway leaves nothing a later one would read (``drop_unfinished`` clears it)."""
    import shutil

    done = directory / spec.name
    part = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=directory))
    _model_dir(spec, part, base)
    try:
        part.rename(done)
    except OSError:
        shutil.rmtree(part, ignore_errors=True)
        if not done.is_dir():  # not another run's copy put in place first (the same weights): a failure
            raise
    return done


def drop_unfinished(spec, directory: Path) -> None:
    """Remove what a run killed while saving ``spec``'s weights under ``directory`` left (its
    private folder, never renamed into place), so it takes no room from the next run's save."""
    import shutil

    for part in directory.glob(f".{spec.name}-*"):
        shutil.rmtree(part, ignore_errors=True)


def no_room_for_weights(spec, dtype, directory: str | None = None) -> str | None:
    """Why ``spec``'s weights in ``dtype`` would not fit, with a tenth to spare, in the temporary
    directory Unsloth's loader reads them from (``TMPDIR`` moves it); None where they fit."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n = AutoModelForCausalLM.from_config(spec.config(), dtype=dtype).num_parameters()
    need = 1.1 * n * dtype.itemsize
    root = directory or tempfile.gettempdir()
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    return (f"{spec.name}'s weights need {need / 2**30:.1f} GiB and {root} has {free / 2**30:.1f} GiB free "
            "(TMPDIR moves it)")


def check(spec, *, device, lora_rank: int | None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
    """PeerUnavailable, saying why, where Unsloth cannot build ``spec`` here."""
    if device.type != "cuda":
        raise PeerUnavailable(f"Unsloth needs a CUDA GPU; this point runs on {device.type}")
    if sys.modules.get("unsloth") is None:
        why = IMPORT_ERROR or ("it was not imported first in this process (a sweep point's and a Trainer bench run's "
                                "processes import it first: python -m harness _point, _trainer_run)")
        raise PeerUnavailable(f"Unsloth cannot run here: {why}")
    if not lora_rank:
        raise PeerUnavailable("the Unsloth stack trains LoRA adapters; this point sets no lora_rank")
    window = longest_length(spec.config())
    if max_seq_length and window and max_seq_length > window:
        raise PeerUnavailable(f"{max_seq_length} tokens is past {spec.name}'s {window} positions: Unsloth would rescale "
                              "its RoPE, and train another model than the stacks beside it")
    if batch_size != 1:
        raise PeerUnavailable(f"Unsloth's per-document attention reads one packed row a step (packed_seq_lengths); "
                              f"this point has {batch_size} rows")


def build(spec, *, device, dtype, lora_rank: int | None, max_seq_length: int, gradient_checkpointing: bool,
          seed: int, batch_size: int = 1, base=None):
    """The point's model, built by Unsloth; PeerUnavailable where it cannot be here. ``base``: a
    bare transformers model of ``spec``, a function that builds one, or the folder
    ``saved_weights`` wrote, whose weights Unsloth loads (else it draws its own random ones), so
    another stack's model can be trained from the same weights."""
    check(spec, device=device, lora_rank=lora_rank, batch_size=batch_size, max_seq_length=max_seq_length)
    import torch
    from unsloth import FastLanguageModel

    with tempfile.TemporaryDirectory(prefix="packbench-unsloth-") as tmp:
        torch.manual_seed(seed)
        try:
            model, _ = FastLanguageModel.from_pretrained(
                str(loader_dir(spec, Path(tmp), base)), max_seq_length=max_seq_length, dtype=dtype,
                load_in_4bit=False, load_in_16bit=True, local_files_only=True)
        except NotImplementedError as e:  # a model type it does not support
            raise PeerUnavailable(f"Unsloth cannot load {spec.name}: {type(e).__name__}: {e}"[:400]) from None
    if rope(model.config) != rope(spec.config()):
        raise RuntimeError(f"Unsloth loaded {spec.name} with RoPE {rope(model.config)}, the shape's is "
                           f"{rope(spec.config())}: another model than the stacks beside it")
    model = FastLanguageModel.get_peft_model(
        model, r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0, bias="none",
        target_modules=_target_modules(spec),
        use_gradient_checkpointing="unsloth" if gradient_checkpointing else False, random_state=seed)
    if gradient_checkpointing:
        FastLanguageModel.for_training(model)
    else:  # its default turns checkpointing on in every module: a no-checkpoint peer would still recompute
        FastLanguageModel.for_training(model, use_gradient_checkpointing=False)
    same_adapters(model, spec, lora_rank)
    return model


def adapter_shapes(model) -> Counter:
    """The shapes of ``model``'s trainable tensors, counted."""
    return Counter(tuple(p.shape) for p in model.parameters() if p.requires_grad)


def same_adapters(model, spec, lora_rank: int) -> None:
    """PeerUnavailable unless Unsloth trains the very adapters the harness's peft build trains (on MoE
    models the attention projections and the experts' fused gate_up/down through peft's
    ``target_parameters``): the harness's build is made on the meta device and its trainable
    shapes compared, so a peer that adapts other weights never stands beside the others. Shapes,
    not names or dtypes: Unsloth may name and keep its adapters its own way, and two projections
    of one shape (k and v) are not told apart."""
    import torch

    from harness.workload import models

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the build seeds every generator; the point's go on as they were
        want = adapter_shapes(models.build(spec, device="meta", dtype=torch.bfloat16, lora_rank=lora_rank,
                                           gradient_checkpointing=False))
    got = adapter_shapes(model)
    if got != want:
        extra, missing = got - want, want - got
        raise PeerUnavailable(
            f"Unsloth's LoRA on {spec.name} is not the harness's: {sum(got.values())} trainable tensors "
            f"({_numel(got):,} weights) against {sum(want.values())} ({_numel(want):,}); "
            f"only Unsloth's: {dict(extra)}; only the harness's: {dict(missing)}"[:600])


def _numel(shapes: Counter) -> int:
    import math

    return sum(math.prod(s) * n for s, n in shapes.items())


def longest_length(config) -> int | None:
    """The longest length Unsloth trains the model of ``config`` at as the other stacks do: its
    ``max_position_embeddings``, past which Unsloth's loader (``_extended_rope_scaling``) puts
    linear RoPE scaling on it; None (no limit) for llama3 RoPE, which it keeps, only widening the
    window, or a config without a window."""
    window = getattr(config, "max_position_embeddings", None)
    return window if window and rope(config)["rope_type"] != "llama3" else None


def rope(config) -> dict:
    """A config's RoPE: its type, scaling factor and base (transformers 5 keeps them in
    ``rope_parameters``, older ones in ``rope_scaling`` and ``rope_theta``)."""
    out = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if value:
            out.update(value if isinstance(value, dict) else vars(value))
    out.setdefault("rope_theta", getattr(config, "rope_theta", None))
    kind = out.get("rope_type") or out.get("type") or "default"
    return {"rope_type": kind, "factor": out.get("factor") if kind != "default" else None,
            "rope_theta": out.get("rope_theta")}


def packed_kwargs(batch) -> dict:
    """What Unsloth's packing collator hands the model besides position_ids: the row's document
    lengths, a host int32 tensor."""
    return lengths_kwargs(batch.lengths[0])


def lengths_kwargs(lengths) -> dict:
    """One packed row's document lengths as Unsloth's forward takes them (``packed_seq_lengths``)."""
    import torch

    return {"packed_seq_lengths": torch.tensor(list(lengths), dtype=torch.int32)}
