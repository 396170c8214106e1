"""FLOPs arithmetic against a hand-checked case, and MFU peak lookup that refuses to guess."""

import pytest
import torch

from harness.measure import flops
from harness.workload import models


def test_attended_pairs_matches_brute_force():
    for length in (1, 5, 17, 64):
        for window in (None, 1, 4, 16, 100):
            i = torch.arange(length)
            mask = (i[None, :] <= i[:, None])
            if window is not None:
                mask &= (i[:, None] - i[None, :]) < window
            assert flops.attended_pairs(length, window) == int(mask.sum()), (length, window)


def test_step_flops_hand_checked():
    # tokens 10; N_frozen 100, N_adapter 10; docs 4 and 6; one full layer, one window-3 layer.
    # pairs: full 10 + 21 = 31; window 3: (6 + 3) + (6 + 9) = 24; total 55
    # attention fwd = 4 * heads 2 * dim 4 * 55 = 1760
    # linear fwd = 2 * 110 * 10 = 2200; linear bwd = 2*100*10 + 4*10*10 = 2400
    # model = 2200 + 2400 + 3 * 1760 = 9880; with recompute + 2200 + 1760 = 13840
    f = flops.step_flops(tokens=10, frozen_params=100, adapter_params=10, doc_lengths=[4, 6],
                         layer_windows=[None, 3], num_heads=2, head_dim=4, recompute=True)
    assert f.attention_fwd_flops == 1760
    assert f.model_flops == 9880
    assert f.hardware_flops == 13840
    g = flops.step_flops(tokens=10, frozen_params=100, adapter_params=10, doc_lengths=[4, 6],
                         layer_windows=[None, 3], num_heads=2, head_dim=4, recompute=False)
    assert g.hardware_flops == g.model_flops == 9880
    # a quarter of the layers recomputed (optim.recompute let the others skip): a quarter of it
    h = flops.step_flops(tokens=10, frozen_params=100, adapter_params=10, doc_lengths=[4, 6],
                         layer_windows=[None, 3], num_heads=2, head_dim=4, recompute=0.25)
    assert h.hardware_flops == 9880 + (2200 + 1760) / 4


def test_peak_lookup_refuses_unknown():
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert flops.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert flops.peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert flops.peak_flops("Imaginary GPU 9000") is None


def test_matmul_params_lora_and_moe_share():
    spec = models.get("qwen3-30b-a3b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4, gradient_checkpointing=False)
    frozen, adapter = flops.matmul_params(m, spec.num_experts, spec.experts_per_token)
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert 0 < adapter < trainable  # expert LoRA counts only at the routed share k/E
    expert = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n and not p.requires_grad)
    embed = spec.vocab_size * spec.hidden_size
    # frozen = dense matmul weights + k/E of the expert weights (the embedding is not a matmul, untied)
    dense = sum(p.numel() for n, p in m.named_parameters()
                if p.dim() >= 2 and not p.requires_grad and ".experts." not in n and "embed_tokens" not in n)
    assert frozen == dense + expert * spec.experts_per_token // spec.num_experts
    assert embed not in (frozen, adapter)


def test_tied_embedding_counted_once_as_output_projection():
    spec = models.get("qwen3-0.6b-tiny")  # tied
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=None, gradient_checkpointing=False)
    m.requires_grad_(False)
    frozen, adapter = flops.matmul_params(m)
    assert adapter == 0
    linear = sum(p.numel() for n, p in m.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n)
    assert frozen == linear + spec.vocab_size * spec.hidden_size


def test_full_finetune_counts_everything_as_trained():
    spec = models.get("llama-3.2-1b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=None, gradient_checkpointing=False)
    frozen, adapter = flops.matmul_params(m)
    assert frozen == 0 and adapter > 0


def test_the_lm_head_is_not_counted_as_recomputed():
    """Checkpointing runs the decoder layers again, never the lm_head and the loss: HFU's extra
    forward leaves the output projection out, and a row of the older count shows no HFU."""
    kw = dict(tokens=1000, frozen_params=600, adapter_params=10, doc_lengths=[1000], layer_windows=[None],
              num_heads=2, head_dim=4)
    plain = flops.step_flops(**kw, recompute=1.0)
    headed = flops.step_flops(**kw, recompute=1.0, head_params=100)
    assert headed.model_flops == plain.model_flops
    assert plain.hardware_flops - headed.hardware_flops == 2.0 * 100 * 1000
    assert flops.step_flops(**kw, recompute=0.0, head_params=100).hardware_flops == plain.model_flops
    spec = models.get("qwen3-0.6b-tiny")
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    cfg = m.config
    assert flops.head_params(m) == cfg.vocab_size * cfg.hidden_size  # tied or not, one output projection
    assert flops.hfu_of({"hfu": 0.5}) is None and flops.hfu_of({"hfu": 0.5, "flops_version": flops.FLOPS_VERSION}) == 0.5


def test_peak_lookup_matches_whole_words():
    assert flops.peak_flops("NVIDIA L40") == 181.05e12 and flops.peak_flops("NVIDIA L4") == 121e12  # not the L4's
    assert flops.peak_flops("NVIDIA H200 NVL") == 835.5e12 and flops.peak_flops("NVIDIA H200") == 989.4e12
    assert flops.peak_flops("NVIDIA GH200 480GB") == 989.4e12 and flops.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops("NVIDIA H100 PCIe") == 756e12 and flops.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
