"""Helpers the LoRA numerics tests share (``randomize_lora_b`` is the harness's own, used by its
gate's parity check)."""

from harness.workload.models import randomize_lora_b  # noqa: F401


def cuda_lora_model(name, rank: int = 16):
    """``name`` (a registry name or a ``ModelSpec``) built on CUDA in bf16 with LoRA ``rank`` (base weights seed 0), every lora_B drawn
    from N(0, 0.02) by a CUDA generator seeded 1, so the adapters take part in the first step's
    forward."""
    import torch

    from harness.workload import models

    spec = models.get(name) if isinstance(name, str) else name
    model = models.build(spec, device="cuda", dtype=torch.bfloat16, lora_rank=rank, seed=0)
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    return model


def measured_step(model, b):
    """One forward and backward of ``model`` on batch ``b`` on CUDA: the loss, every gradient (fp32
    copies), the step's peak above what was allocated at its start (GiB) and its time (ms, CUDA
    events). Gradients accumulate onto what the caller left."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False).loss
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, (torch.cuda.max_memory_allocated() - base) / 2**30, start.elapsed_time(end)
