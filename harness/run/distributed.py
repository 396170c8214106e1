"""A sweep point on several GPUs: one process per GPU, started by ``torchrun``
(``harness.run.launchers.TorchrunLauncher``), the LoRA model sharded with FSDP2.

What each rank does is what a user's FSDP2 script does with this project: build the model and
its adapters, ``optim.enable`` it (the point's switches), then ``fully_shard`` every decoder
layer and the root, so the frozen base is sharded and each layer is gathered just before it
runs (and again for its recompute). Parameters keep their dtypes (a bf16 base, the adapters in
``lora_dtype``); gradients are reduced in fp32. Each rank trains on its own packed rows: batch
``i`` of rank ``r`` is batch ``i * world + r`` of the point's stream, so N ranks see the same
global batches as one process accumulating N micro-batches.

``python -m harness _point`` under torchrun: rank 0 writes the point's row, with every rank's
figures (``per_rank``); a rank that fails writes its own row beside it and exits non-zero, so
torchrun stops the others and the point's row says which rank failed and why.

On CPU the group uses gloo (N processes on one machine): how the CPU tests run FSDP2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    def batch_step(self, i: int) -> int:
        """The stream index of this rank's batch ``i``."""
        return i * self.size + self.rank


def world() -> World | None:
    """This process's place in a torchrun group, or None when torchrun did not start it."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def setup(device: torch.device) -> tuple[World, torch.device]:
    """Join the group (NCCL on CUDA, gloo on CPU); this rank's device."""
    import torch.distributed as dist

    w = world()
    if w is None:
        raise RuntimeError("a parallel point runs under torchrun (harness.run.launchers.TorchrunLauncher); "
                           "RANK and WORLD_SIZE are not set")
    if device.type == "cuda":
        if torch.cuda.device_count() < w.size:
            raise RuntimeError(f"{w.size} ranks on one host need {w.size} GPUs; {torch.cuda.device_count()} visible")
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return w, device


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' ``GradientCheckpointingLayer``s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def shard(model: torch.nn.Module) -> int:
    """``fully_shard`` every decoder layer, then the root; returns how many layers."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers to shard")
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return len(layers)


def collective_ms(step) -> dict:
    """One more ``step()`` under the profiler: the GPU time of its NCCL kernels (all-gathers,
    reduce-scatters, all-reduces; whether or not compute overlapped them) and how many ran. On
    a CPU group the profiler cannot tell gloo's work from the ops that wait on it: None."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available() or dist.get_backend() != "nccl":
        return {"collective_ms": None, "collective_kernels": None}

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    nccl = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()]
    return {"collective_ms": sum(e.device_time for e in nccl) / 1e3, "collective_kernels": len(nccl)}


def gather(obj) -> list:
    """Every rank's ``obj``, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish() -> None:
    """Every rank waits for the others (rank 0 has written the point's row by then), then leaves
    the group: no rank's exit can stop another that still has work."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    teardown()
