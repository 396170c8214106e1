"""What a process may still allocate on a CUDA device, as the memory-aware switches read it."""

from __future__ import annotations

import torch


def usable_and_total(device: torch.device) -> tuple[int, int]:
    """What the process can still allocate on ``device`` (free on the device plus the caching
    allocator's unused blocks) and what it may hold in all: the device's memory, or the share
    ``torch.cuda.set_per_process_memory_fraction`` gives it, past which the allocator raises an
    out-of-memory error whatever the device has free. ``device`` may be ``torch.device("cuda")``
    without an index: the current device, as torch's allocating calls read it."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    alloc = torch.cuda.memory_allocated(device)
    usable = free + max(0, torch.cuda.memory_reserved(device) - alloc)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    if fraction < 1.0:
        cap = int(fraction * total)
        return min(usable, max(0, cap - alloc)), cap
    return usable, total
