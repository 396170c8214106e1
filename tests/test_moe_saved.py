"""moe_saved: what the compiled grouped_mm experts layer keeps for backward, counted per routed
token. The tensors autograd saves are counted (``saved_tensors_hooks``, each storage once, the
parameters left out) at two token counts: the difference is the per-token memory, free of the
LoRA factors' per-layer copies. ``all`` (the partitioner's default) keeps the routed rows, the
gate/up output, the gate's output and the down output; ``lean`` keeps the layer's input and the
gate/up output only, and its numbers match (tests/test_moe.py)."""

from __future__ import annotations

import pytest
import torch
from _moe_common import MODELS, build, experts_of

import optim.moe as moe

RANK = 8  # bf16: 16-byte LoRA rows, no padding


def _saved_bytes(experts, params, T, H, k, E):
    seen, total = set(), [0]
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.data_ptr() not in skip and key not in seen:
            seen.add(key)
            total[0] += st.nbytes()
        return t

    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g).to(torch.bfloat16).requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = experts(hidden, idx, wts)
    out.float().sum().backward()
    return total[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_lean_keeps_the_input_and_the_gate_up_output_per_routed_token(name):
    from optim import _moe_compiled as compiled

    model = build(name, "cpu", torch.bfloat16, RANK)
    cfg = model.config
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    E = experts_of(model).get_base_layer().num_experts
    inter = experts_of(model).get_base_layer().gate_up_proj.shape[-1] // 2  # (E, H, 2I): gate and up
    params = [p for p in model.parameters()]
    per_token = {}
    for saved in ("all", "lean"):
        moe.enable(model, moe_backend="grouped_mm", moe_lora="split", moe_compile=True, moe_saved=saved)
        experts = experts_of(model)
        a, b = (_saved_bytes(experts, params, T, H, k, E) for T in (64, 192))
        assert ("cpu", torch.bfloat16) not in compiled.COMPILE_FAILED, compiled.COMPILE_FAILED
        per_token[saved] = (b - a) / 128 / 2  # bf16 values per token
    moe.enable(model)
    lora_mid = 2 * k * RANK  # x·A of each projection, per routed row
    # lean: the input row once, the gate/up output per routed row, the LoRA middles; the routing's
    # integers, kept so that backward never sorts again (int64, four bf16 values each per routed
    # row: the sort order, the token index, and the expert ids where the bias gathers read them);
    # and the routing weights (one each)
    biased = getattr(experts_of(model).get_base_layer(), "gate_up_proj_bias", None) is not None
    ints = 1 + (k > 1) + biased  # the token index is the sort order itself at top-1
    lean = H + k * 2 * inter + lora_mid + k * (4 * ints + 1)
    assert per_token["lean"] == lean, (per_token, lean)
    # all: the routed rows, the gate/up output, the gate's output and the down output as well
    assert per_token["all"] >= k * (H + 2 * inter + inter + H) + lora_mid, per_token
