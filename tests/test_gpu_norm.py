"""optim.norm on CUDA: the final RMSNorm in token chunks at Llama-3.1-8B's hidden size, 32775 bf16
tokens (eight chunks and a last one of seven). The output is the stock norm's to the bit, the input's gradient within bf16 rounding of
autograd's through the stock norm, and the forward + backward peak well under the stock one's
(which keeps an fp32 copy of the input and makes several fp32 tensors of every token at once in
its backward). Prints both peaks."""

import pytest
import torch

import optim.norm as N

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN, CHUNK = 32768 + 7, 4096, 4096  # a last chunk of 7 tokens: a reduction of another shape


def _run(m, x, g):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = m(x)
    dx, = torch.autograd.grad(y, x, g)
    torch.cuda.synchronize()
    return y.detach(), dx, (torch.cuda.max_memory_allocated() - base) / TOKENS / 1024


def test_chunked_final_norm_matches_the_stock_norm_and_peaks_lower():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    m = LlamaRMSNorm(HIDDEN, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen))
    m.weight.requires_grad_(False)  # frozen, as under LoRA
    x = (3 * torch.randn(1, TOKENS, HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    g = torch.randn(1, TOKENS, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    y0, dx0, stock_peak = _run(m, x, g)
    assert N._form(m) == "weight_after_cast"
    m.__class__ = N._chunked_class(type(m))
    m._optim_norm_chunk, m._optim_norm_form = CHUNK, "weight_after_cast"
    y1, dx1, chunked_peak = _run(m, x, g)
    err = ((dx0.float() - dx1.float()).norm() / dx0.float().norm()).item()
    print(f"forward + backward peak: stock {stock_peak:.1f} KiB a token, chunked {chunked_peak:.1f}; "
          f"input gradient relative difference {err:.2e}", flush=True)
    assert vars(m)["_optim_norm_calls"] == 1
    assert torch.equal(y0, y1)
    assert err < 2e-2, err
    assert chunked_peak < 0.5 * stock_peak, (stock_peak, chunked_peak)
