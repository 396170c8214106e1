"""Shared by the GPU sweep tests: one small point (Qwen3-0.6B, 1024 tokens, bf16 on CUDA) with the
variants a test names, built through the same parser as an experiment file."""

from __future__ import annotations

from harness.run import experiment

SMALL_GPU_POINT = {"models": ["qwen3-0.6b"], "seq_lens": [1024], "device": "cuda", "bandwidth": False,
                   "timeout_s": 300}


def small_gpu_experiment(name: str, variants: dict[str, dict], **overrides) -> experiment.Experiment:
    return experiment.parse({"experiment": {"name": name, **SMALL_GPU_POINT, **overrides}, "variants": variants},
                            path=f"<{name}>")
