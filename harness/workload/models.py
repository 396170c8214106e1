"""Registry of real model shapes (public configs), their tiny CPU twins and few-layer cuts.

Nothing is downloaded: models are built from configs with random, properly initialized weights,
directly on the target device (bf16 on GPU). LoRA comes from peft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the registry is read where torch is not imported (checking an experiment file)
    import torch


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    tiny: bool = False

    @property
    def is_moe(self) -> bool:
        return self.family in ("qwen3_moe", "gpt_oss")

    @property
    def num_experts(self) -> int:
        return int(self.extra.get("num_local_experts", 0))

    @property
    def experts_per_token(self) -> int:
        return int(self.extra.get("num_experts_per_tok", 0))

    def config(self):
        """A transformers config for this shape."""
        import transformers

        cls = {
            "llama": transformers.LlamaConfig,
            "qwen3": transformers.Qwen3Config,
            "qwen3_moe": transformers.Qwen3MoeConfig,
            "gpt_oss": transformers.GptOssConfig,
        }[self.family]
        kw = dict(
            num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            use_cache=False,
        )
        kw.update(self.extra)
        return cls(**kw)


def _tiny(spec: ModelSpec) -> ModelSpec:
    """Same architecture (family, GQA ratio, tying, MoE routing, sinks, sliding window), toy size."""
    kv = 2
    heads = kv * max(1, spec.num_attention_heads // spec.num_key_value_heads)
    heads = min(heads, 8)
    extra = dict(spec.extra)
    if spec.family == "qwen3_moe":
        extra.update(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if spec.family == "gpt_oss":
        extra.update(num_local_experts=8, num_experts_per_tok=2, sliding_window=32)
        extra["layer_types"] = ["sliding_attention", "full_attention"]
    return ModelSpec(
        name=f"{spec.name}-tiny",
        family=spec.family,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=64 if spec.family == "gpt_oss" else 128,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        extra=extra,
        tiny=True,
    )


_GPT_OSS = dict(
    sliding_window=128,
    attention_bias=True,
    swiglu_limit=7.0,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False,
    },
)

_REAL = [
    ModelSpec("llama-3.2-1b", "llama", 16, 2048, 8192, 32, 8, 64, 128256, tie_word_embeddings=True,
              extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    # Llama 3.1's own RoPE: llama3 scaling of the 8192 positions it was trained at, to 131072
    ModelSpec("llama-3.1-8b", "llama", 32, 4096, 14336, 32, 8, 128, 128256,
              extra=dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})),
    ModelSpec("qwen3-0.6b", "qwen3", 28, 1024, 3072, 16, 8, 128, 151936, 40960, tie_word_embeddings=True,
              extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ModelSpec("qwen3-8b", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, 40960,
              extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3-8B as its model card extends it past 32768 positions: YaRN, factor 4, to 131072. The
    # long-context shape, where the plain one's 40960 positions would stop one stack (Unsloth
    # rescales RoPE past them) and not the others.
    ModelSpec("qwen3-8b-yarn", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, 131072,
              extra=dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 32768})),
    ModelSpec("qwen3-14b", "qwen3", 40, 5120, 17408, 40, 8, 128, 151936, 40960,
              extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ModelSpec("qwen3-32b", "qwen3", 64, 5120, 25600, 64, 8, 128, 151936, 40960,
              extra=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ModelSpec("qwen3-30b-a3b", "qwen3_moe", 48, 2048, 6144, 32, 4, 128, 151936, 40960,
              extra=dict(num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                         norm_topk_prob=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ModelSpec("gpt-oss-20b", "gpt_oss", 24, 2880, 2880, 64, 8, 64, 201088,
              extra=dict(num_local_experts=32, num_experts_per_tok=4,
                         layer_types=["sliding_attention", "full_attention"] * 12, **_GPT_OSS)),
    ModelSpec("gpt-oss-120b", "gpt_oss", 36, 2880, 2880, 64, 8, 64, 201088,
              extra=dict(num_local_experts=128, num_experts_per_tok=4,
                         layer_types=["sliding_attention", "full_attention"] * 18, **_GPT_OSS)),
]

def _layers(spec: ModelSpec, n: int) -> ModelSpec:
    """The real model's layer shapes (hidden size, experts, vocabulary) with ``n`` decoder layers:
    what one layer costs, at a fraction of the build and compile time (gate suites)."""
    extra = dict(spec.extra)
    if "layer_types" in extra:
        extra["layer_types"] = extra["layer_types"][:n]
    return dataclasses.replace(spec, name=f"{spec.name}-{n}l", num_hidden_layers=n, extra=extra)


REGISTRY: dict[str, ModelSpec] = {}
for _s in _REAL:
    REGISTRY[_s.name] = _s
    REGISTRY[f"{_s.name}-tiny"] = _tiny(_s)
for _s, _n in ((REGISTRY["qwen3-0.6b"], 4), (REGISTRY["qwen3-8b"], 4), (REGISTRY["gpt-oss-20b"], 2),
               (REGISTRY["qwen3-30b-a3b"], 2)):
    REGISTRY[f"{_s.name}-{_n}l"] = _layers(_s, _n)


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> ModelSpec:
    """Look a model up by name, case-insensitively (``Qwen3-0.6B`` and ``qwen3-0.6b`` are one)."""
    key = str(name).lower()
    if key not in REGISTRY:
        raise KeyError(name)
    return REGISTRY[key]


def lora_config(spec: ModelSpec, rank: int):
    """peft LoRA: all linear projections on dense models; on MoE models the attention
    projections plus the experts' fused gate_up_proj/down_proj via ``target_parameters``."""
    from peft import LoraConfig

    if spec.is_moe:
        return LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")


# fp32: peft's default, adapters upcast to float32; model: adapters in the model's dtype
LORA_DTYPES = ("fp32", "model")


def build(
    spec: ModelSpec,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
    lora_rank: int | None = 16,
    gradient_checkpointing: bool = True,
    checkpoint_fn=None,
    seed: int = 0,
    lora_dtype: str = "fp32",
    checkpoint_preserve_rng: bool = True,
    before_lora=None,
):
    """Build ``spec`` with random initialized weights directly on ``device``, optionally with LoRA.

    ``lora_dtype``: "fp32" is peft's default (adapter weights upcast to float32, and so their
    grads and AdamW states); "model" keeps them in ``dtype``. Returns the (peft-wrapped) model in
    train mode. ``before_lora(model)``, if given, is applied to the bare model before peft wraps
    it, as a user applies Liger-Kernel's patches to the model they loaded.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from harness.variant_keys import stock_attn_for

    attn_implementation = stock_attn_for(spec.family, attn_implementation)
    config = spec.config()
    if experts_implementation is not None and spec.is_moe:
        config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if not checkpoint_preserve_rng:  # a CUDA-graph capture cannot read the RNG state
            kwargs["preserve_rng_state"] = False
        # transformers 5.23 renamed it activation_checkpointing_enable (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if checkpoint_fn is not None:  # transformers routes every layer through this function
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_fn)
    if before_lora is not None:
        before_lora(model)
    if lora_rank:
        from peft import get_peft_model

        if lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {lora_dtype!r}")
        model = get_peft_model(model, lora_config(spec, lora_rank),
                               autocast_adapter_dtype=lora_dtype == "fp32")
    model.train()
    return model


def randomize_lora_b(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> torch.nn.Module:
    """Draw every lora_B from N(0, std), torch's global generator seeded with ``seed``.

    peft starts lora_B at zero, which leaves every lora_A gradient zero and the adapters out of
    the forward, so a wrong LoRA path would look right to a numerics check.
    """
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return model
