"""Run by tests/test_trainers.py under torchrun: transformers.Trainer on the tiny Qwen3 shape on
CPU, DistributedDataParallel over gloo, stock or with optim.enable; rank 0 writes the losses.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_ddp_trainer.py {stock|ours} OUT_DIR RESULT.json
"""

import json
import os
import sys

import torch.distributed as dist

from harness.workload.trainers import documents, trainer_run

side, out_dir, result = sys.argv[1:4]
docs = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in documents(48, 512, 5, 30)]
run = trainer_run("qwen3-0.6b-tiny", ours=side == "ours", steps=4, batch_size=2, docs=docs, max_length=128,
                  out_dir=out_dir, logging_steps=1)
if dist.get_rank() == 0:
    with open(result, "w") as f:
        json.dump({"losses": run["losses"], "logged_losses": run["logged_losses"], "world_size": dist.get_world_size(), "enabled": sorted(run["enabled"]),
                   "wrapped": run["wrapped"]}, f)
# leave the process group before exit: gloo's threads torn down at interpreter exit can abort rank 0
dist.barrier()
dist.destroy_process_group()
# and leave without the interpreter's teardown: a C++ thread still joinable then (std::terminate, "terminate
# called without an active exception") has aborted a rank whose training and result were done, rarely
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
