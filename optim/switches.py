"""Switch declarations: the ``Switch`` type and every optim module's switches.

A switch has a name, its valid choices, a default and an environment variable. A value is
taken from, in order: the keyword passed to ``enable``, the environment variable, the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    name: str
    choices: tuple[Any, ...]
    default: Any
    help: str

    @property
    def env_var(self) -> str:
        return f"OPTIM_{self.name.upper()}"

    def parse(self, raw: Any) -> Any:
        """Validate a value (from code or an environment string) against the choices."""
        value = raw
        if isinstance(raw, str):
            low = raw.strip().lower()
            if True in self.choices and low in ("1", "true", "on", "yes"):
                value = True
            elif False in self.choices and low in ("0", "false", "off", "no"):
                value = False
            elif low.isdigit() and any(type(c) is int for c in self.choices):
                value = int(low)  # an environment variable's number
            else:
                value = low
        if not any(value == c and type(value) is type(c) for c in self.choices):
            # by type too: 1 == True in Python, and a row must record the bool the switch takes
            raise ValueError(
                f"{self.name}={raw!r} is not valid (valid: {', '.join(map(str, self.choices))})"
            )
        return value

    def resolve(self, explicit: Any = None) -> Any:
        if explicit is not None:
            return self.parse(explicit)
        if self.env_var in os.environ:
            try:
                return self.parse(os.environ[self.env_var])
            except ValueError as e:  # say where the value came from: no keyword named it
                raise ValueError(f"{e} (from the environment variable {self.env_var})") from None
        return self.default


# Every optimization's switches, by the module that owns them. Declared here, apart from the
# modules (which import torch), so an experiment file's switches are checked without importing
# torch; each module takes its own with ``switches_of(__name__)``.
PACKING_BACKENDS = ("sdpa", "flex", "varlen")
OFFLOAD_MODES = ("none", "single", "double", "save_on_cpu")

DECLARED: dict[str, dict[str, Switch]] = {
    "optim.packing": {
        s.name: s
        for s in (
            Switch(
                "packing_cache",
                (True, False),
                True,
                "build packed-sequence metadata and attention structures once per batch (off: in "
                "every layer call and every recompute, the behaviour the published figures measured against)",
            ),
            # "auto" picks the fastest path that can run, from the measured table in
            # backends.AUTO_ON_CUDA: flex where optim.regional compiles the layers (traced into their
            # graph), FlashAttention-2 varlen where they run eager; SDPA with an explicit mask loses
            # the flash kernel, so it is only the CPU choice.
            Switch(
                "packing_backend",
                ("auto", *PACKING_BACKENDS, "off"),
                "auto",
                "packed attention kernel: auto = on CUDA flex with compiled layers, else varlen "
                "(fp16/bf16, when torch has it); sdpa on CPU; off = leave the model's attention alone (stock)",
            ),
            # Off by default: a row of one document then runs FlashAttention varlen instead of causal
            # SDPA, whose kernel is faster at every length harness.bench.attention measured
            # (results/packing/, varlen-split against sdpa-causal); it is a switch for memory first.
            Switch(
                "attention_split",
                (False, True),
                False,
                "run FlashAttention varlen's backward one group of query heads at a time (CUDA, fp16/bf16): "
                "its fp32 dQ accumulator and the dK, dV it writes per query head before summing over grouped "
                "KV heads then exist for one group, not for all heads at once; rows of one document then run "
                "varlen instead of causal SDPA (flex, where compiled layers run it, is left as it is)",
            ),
            Switch(
                "validate",
                (True, False),
                True,
                "check the position_ids passed beside packing= or cu_seq_lens_q against that metadata, once "
                "per batch on its device with no host sync (on a GPU a disagreement raises by the next batch "
                "at the latest); off = trust them",
            ),
        )
    },
    "optim.moe": {
        s.name: s
        for s in (
            Switch(
                "moe_backend",
                ("auto", "loop", "sorted", "grouped_mm"),
                "auto",
                "MoE experts routing: per-expert torch.where loop, argsort+bincount sorted slices "
                "(1 host sync/layer), or grouped_mm (no sync); auto = grouped_mm on CUDA SM90+, else sorted",
            ),
            Switch(
                "moe_lora",
                ("split", "merged"),
                "split",
                "LoRA on expert weights: split = (X·A_e)·B_e on routed tokens only; merged = peft's W + B·A "
                "for all experts",
            ),
            Switch(
                "moe_compile",
                ("auto", True, False),
                "auto",
                "torch.compile the grouped_mm experts layer (static shapes, one graph for every layer): "
                "fuses the gate, biases and routing weights around the grouped GEMMs and cuts "
                "the kernel launches; auto = on CUDA",
            ),
            Switch(
                "moe_saved",
                ("all", "lean"),
                "all",
                "what the compiled grouped_mm experts layer keeps for backward: all = the partitioner's "
                "default (the routed rows, the gate/up output, the gate's output and the down output: 5 "
                "hidden-size rows per routed token); lean = the layer's input and the gate/up output only "
                "(2.25 rows), the routing weights applied before the down projection, the gather and gate "
                "recomputed in backward (no GEMM recomputed): less activation memory for a slower backward; "
                "a batch whose tokens x top-k rows are not a 16-byte multiple runs all",
            ),
            Switch(
                "moe_train_router",
                (False, True),
                False,
                "train the MoE router weights (frozen by default)",
            ),
        )
    },
    "optim.lora": {
        s.name: s
        for s in (
            Switch(
                "lora",
                ("fused", "peft"),
                "fused",
                "peft's LoRA Linear layers: fused = base and adapter in one autograd function in the model's "
                "dtype, saving the layer's input once (no fp32 copy per projection; fp32 master weights and "
                "adapter gradients kept); peft = peft's own forward (input cast to the adapters' fp32)",
            ),
        )
    },
    "optim.mlp": {
        s.name: s
        for s in (
            # Off by default: chunking costs the gate and up projections once more per MLP.
            Switch(
                "mlp_chunk",
                ("off", 256, 512, 1024, 2048, 4096, 8192, 16384),
                "off",
                "SwiGLU MLPs in chunks of this many tokens, keeping only their input for the backward "
                "(which recomputes each chunk's gate and up projections): no tokens x intermediate tensor "
                "is kept; off = the MLP's own forward",
            ),
        )
    },
    "optim.norm": {
        s.name: s
        for s in (
            # Off by default until measured on a GPU: what it saves is the final norm's fp32 copies,
            # for a loop over the tokens in eager PyTorch.
            Switch(
                "norm_chunk",
                ("off", 1024, 2048, 4096, 8192, 16384),
                "off",
                "the decoder stack's final RMSNorm (outside the compiled layers) in chunks of this many "
                "tokens, keeping its input and one fp32 value a token for the backward instead of an fp32 "
                "copy of the input, and making the backward's fp32 tensors one chunk at a time; off = the "
                "norm's own forward",
            ),
        )
    },
    "optim.offload": {
        s.name: s
        for s in (
            # Off by default: offloading trades step time for VRAM, and whether a run is memory-bound
            # is not something this module can know. When a run needs the memory, "double" is the
            # value to pick (it hides the reloads behind the backward compute).
            Switch(
                "offload",
                OFFLOAD_MODES,
                "none",
                "checkpointed layer inputs to pinned host memory: none = plain GPU checkpointing; "
                "single = one staging buffer (copy, wait, compute); double = two buffers, reload of "
                "layer i-1 prefetched during layer i's backward; save_on_cpu = PyTorch's "
                "save_on_cpu(pin_memory=True) around checkpointing (peer)",
            ),
            Switch(
                "offload_guard",
                (True, False),
                True,
                "use the second staging buffer only when the memory the process can still allocate "
                "covers the step's peak growth, the buffer and a headroom (else fall back to single)",
            ),
            # Off by default: reading the events syncs, once, when stats() is read.
            Switch(
                "offload_profile",
                (True, False),
                False,
                "time each reload (c) and each layer's recompute + backward (g) with CUDA events, so "
                "stats() gives reload_ms and backward_ms and the (n-1)*min(c,g) bound can be read off a run",
            ),
        )
    },
    "optim.recompute": {
        s.name: s
        for s in (
            Switch(
                "recompute",
                ("auto", "all"),
                "auto",
                "checkpointed layers: auto = a layer skips its recompute while its activations fit in the "
                "GPU memory the step leaves free (measured in the first step, decided per batch from its "
                "tokens; CUDA); all = every checkpointed layer recomputes (plain checkpointing)",
            ),
        )
    },
    "optim.loss": {
        s.name: s
        for s in (
            Switch(
                "fused_loss",
                (True, False),
                True,
                "lm_head + cross-entropy in token chunks with the gradient computed in the forward: "
                "the full fp32 logits never exist (training mode with labels; eval keeps the logits)",
            ),
            Switch(
                "loss_kernel",
                ("auto", "compiled", "eager", "cce"),
                "auto",
                "how fused_loss computes a chunk: compiled (one torch.compile'd softmax-gradient kernel "
                "writing into the chunk's logits, no fp32 copy), eager (the same math op by op), cce "
                "(Apple's cut-cross-entropy, if installed: no logits at all). auto = compiled on CUDA, "
                "eager elsewhere",
            ),
        )
    },
    "optim.regional": {
        s.name: s
        for s in (
            Switch(
                "compile_layers",
                ("auto", True, False),
                "auto",
                "torch.compile each decoder layer (one shared graph; attention of optim.packing and MoE "
                "blocks stay eager): fewer kernel launches where the step is host-bound. auto = on CUDA",
            ),
        )
    },
    "optim.collector": {
        s.name: s
        for s in (
            Switch(
                "gc_threshold",
                ("off", 10000, 20000, 50000, 100000, 200000, 500000),
                "off",
                "raise Python's cycle collector's young threshold to this many net allocations while the "
                "model is enabled, so a training step's objects die before a collection sees them and full "
                "collections, which stall a host-bound step, become rare; only ever raised, put back when the "
                "last enabled model is disabled; off (the default: with compiled layers a GPU step runs few "
                "collections, and the raise measured no gain) = the collector as the process has it",
            ),
        )
    },
}


def switches_of(module: str) -> dict[str, Switch]:
    """The switches ``module`` (an ``optim.MODULES`` name) declares."""
    return DECLARED[module]
