"""Phase timers: CUDA events on GPU (read once, at the end), perf_counter on CPU."""

from __future__ import annotations

import time

import torch


def percentiles(samples: list[float]) -> dict:
    """p20/p50/p80 (linear interpolation) plus the raw samples."""
    if not samples:
        return {"p20": None, "p50": None, "p80": None, "samples": []}
    t = torch.tensor(samples, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return {"p20": q[0], "p50": q[1], "p80": q[2], "samples": list(samples)}


class PhaseTimer:
    """Marks phase boundaries within each step without a host sync.

    On CUDA each mark records an event on the current stream; elapsed times are read after a
    single synchronize at the end of the run. On CPU the clock is read directly.
    """

    def __init__(self, phases: tuple[str, ...], device: torch.device):
        self.phases = phases
        self.cuda = device.type == "cuda"
        self._steps: list[list] = []

    def start_step(self) -> None:
        self._steps.append([self._mark()])

    def mark(self) -> None:
        """End of the next phase in ``phases``."""
        self._steps[-1].append(self._mark())

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def discard(self) -> None:
        self._steps.clear()

    def results_ms(self) -> dict[str, list[float]]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {p: [] for p in self.phases}
        out["step"] = []
        for marks in self._steps:
            if len(marks) != len(self.phases) + 1:
                raise RuntimeError(f"step has {len(marks) - 1} phase marks, expected {len(self.phases)}")
            for i, phase in enumerate(self.phases):
                out[phase].append(self._elapsed_ms(marks[i], marks[i + 1]))
            out["step"].append(self._elapsed_ms(marks[0], marks[-1]))
        return out

    def _elapsed_ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3
