"""A helper the LoRA numerics tests share."""

from __future__ import annotations

import torch


def randomize_lora_b(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> torch.nn.Module:
    """Draw every lora_B from N(0, std), torch's global generator seeded with ``seed``.

    peft starts lora_B at zero, which leaves every lora_A gradient zero and would make a wrong
    LoRA path look right.
    """
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return model
