"""A helper the LoRA numerics tests share (the harness's own, used by its gate's parity check)."""

from harness.workload.models import randomize_lora_b  # noqa: F401
