"""Model registry: real shapes as published, tiny twins of the same architecture, random
initialized weights, LoRA on the right targets."""

import pytest
import torch

from harness.workload import models

REAL = ["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
        "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"]


def test_registry_has_real_shapes_and_tiny_twins():
    for name in REAL:
        assert models.get(name).name == name and not models.get(name).tiny
        tiny = models.get(name + "-tiny")
        assert tiny.family == models.get(name).family and tiny.tiny
        assert tiny.tie_word_embeddings == models.get(name).tie_word_embeddings
    assert models.get("Qwen3-0.6B") is models.get("qwen3-0.6b")
    with pytest.raises(KeyError):
        models.get("nope")


def test_real_configs_match_reference():
    q = models.get("qwen3-14b").config()
    assert (q.num_hidden_layers, q.hidden_size, q.intermediate_size, q.num_attention_heads,
            q.num_key_value_heads, q.head_dim, q.vocab_size) == (40, 5120, 17408, 40, 8, 128, 151936)
    g = models.get("gpt-oss-20b").config()
    assert (g.num_hidden_layers, g.num_local_experts, g.num_experts_per_tok, g.sliding_window) == (24, 32, 4, 128)
    assert g.layer_types[:2] == ["sliding_attention", "full_attention"]
    m = models.get("qwen3-30b-a3b").config()
    assert (m.num_local_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (128, 8, 768, True)
    assert models.get("llama-3.2-1b").config().tie_word_embeddings is True
    # the long-context shapes' RoPE as their model cards give it: Llama 3.1's llama3 scaling, Qwen3's YaRN x4
    ll, qy = models.get("llama-3.1-8b").config(), models.get("qwen3-8b-yarn").config()
    assert (ll.rope_parameters["rope_type"], ll.rope_parameters["factor"], ll.max_position_embeddings,
            ll.rope_parameters["original_max_position_embeddings"]) == ("llama3", 8.0, 131072, 8192)
    assert (qy.rope_parameters["rope_type"], qy.rope_parameters["factor"], qy.max_position_embeddings,
            qy.rope_parameters["original_max_position_embeddings"]) == ("yarn", 4.0, 131072, 32768)


@pytest.mark.parametrize("name", [n + "-tiny" for n in ("llama-3.2-1b", "qwen3-0.6b", "qwen3-30b-a3b", "gpt-oss-20b")])
def test_tiny_builds_with_initialized_weights_and_lora(name):
    spec = models.get(name)
    model = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    named = dict(model.named_parameters())
    for pname, p in named.items():
        assert torch.isfinite(p).all(), pname
        if p.dim() >= 2 and "lora_B" not in pname and "bias" not in pname:  # LoRA B and biases start at zero by design
            assert p.float().std() > 0, f"{pname} is constant: not initialized"
    trainable = [n for n, p in named.items() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable)
    if spec.is_moe:
        # expert weights carry LoRA through peft's target_parameters
        assert any("experts" in n and "lora_A" in n for n in trainable)
    else:
        assert any("mlp.down_proj.lora_A" in n for n in trainable)
    assert model.base_model.model.is_gradient_checkpointing
    ids = torch.randint(0, spec.vocab_size, (1, 32))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(named[n].grad is not None for n in trainable if "lora_A" in n)


@pytest.mark.parametrize("lora_dtype, want", [("fp32", torch.float32), ("model", torch.bfloat16)])
def test_lora_dtype_sets_the_adapters_dtype_on_moe_experts_too(lora_dtype, want):
    spec = models.get("qwen3-30b-a3b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.bfloat16, lora_rank=4, lora_dtype=lora_dtype)
    trainable = [(n, p.dtype) for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(d == want for _, d in trainable)
    assert any("experts" in n for n, _ in trainable)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters() if not p.requires_grad)
