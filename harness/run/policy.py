"""Run policy: how a point's process is started. Not part of a point's identity."""

# A fresh interpreter per point, or a fork of a server that imported torch/transformers/peft once
# (harness.run.launchers); a launcher for several GPUs per point (torchrun) registers here too.
LAUNCHERS = ("process", "preloaded")
# A point of an experiment with parallel = "fsdp2": torchrun, one process per GPU (not a file's choice)
MULTI_GPU_LAUNCHERS = ("torchrun",)
