"""Host-to-device copy bandwidth, pinned vs pageable, 1 MiB to 1 GiB, against the PCIe ceiling."""

from __future__ import annotations

import torch

from harness.measure import env as envmod
from harness.measure.timing import percentiles

DEFAULT_SIZES = [2**20 * 4**i for i in range(6)]  # 1 MiB, 4 MiB, ..., 1 GiB


def measure_h2d(sizes: list[int] = DEFAULT_SIZES, repeats: int = 10, warmup: int = 2) -> list[dict]:
    """One row per (memory kind, size): GB/s samples, each an event-timed copy.

    The destination is preallocated so the timing holds the copy alone. A pageable copy is staged
    by the driver through its own pinned buffer, which is the cost a naive offload pays.
    """
    if not torch.cuda.is_available():
        from harness.errors import InputError

        raise InputError("bandwidth measures host-to-device copies to a CUDA GPU, and this machine has none")
    info = envmod.nvml_info(0)
    gen = info.get("pcie_max_gen") or info.get("pcie_gen")
    width = info.get("pcie_max_width") or info.get("pcie_width")
    ceiling = envmod.pcie_ceiling_gbps(gen, width)
    rows = []
    stream = torch.cuda.Stream()
    for memory in ("pinned", "pageable"):
        for size in sizes:
            src = torch.empty(size, dtype=torch.uint8, pin_memory=(memory == "pinned"))
            src.fill_(1)  # touch the pages so first-touch faults stay out of the timing
            dst = torch.empty(size, dtype=torch.uint8, device="cuda")
            samples = []
            with torch.cuda.stream(stream):
                for i in range(warmup + repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dst.copy_(src, non_blocking=(memory == "pinned"))
                    end.record(stream)
                    end.synchronize()
                    if i >= warmup:
                        samples.append(size / (start.elapsed_time(end) * 1e-3) / 1e9)
            rows.append({
                "kind": "bandwidth", "direction": "h2d", "memory": memory, "size_bytes": size,
                "gbps": percentiles(samples), "pcie_ceiling_gbps": ceiling,
                "pcie_gen": gen, "pcie_width": width, "status": "ok", "message": "",
            })
            del src, dst
    return rows
