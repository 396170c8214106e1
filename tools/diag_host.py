"""Why do host-bound sweep points spread? A diagnosis to run on the GPU machine.

    python3 tools/diag_host.py --out $OUT/diag_host.json

Records the host (CPU model, NUMA nodes, the GPU's NVML CPU affinity, steal time), times a
pure-Python loop on one core (is the host itself steady?), then runs Qwen3-0.6B at 2048 packed
tokens (stock sdpa, LoRA r=16, checkpointing: the most host-bound smoke-gpu point) in a fresh
process per configuration: no pinning, one core, one core with the GC on, and the GPU's
NUMA-local cores. Per configuration: every step's CUDA-event time and host issue time, the
p80/p20 spread, the drift (last 10 steps over first 10) and the syncs in one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.measure.env import nvml_handle  # noqa: E402
from harness.measure.timing import percentiles  # noqa: E402


def _stats(xs):
    p = percentiles(xs)
    return {**p, "spread": p["p80"] / p["p20"],
            "drift": statistics.median(xs[-10:]) / statistics.median(xs[:10])}


def _steal():
    fields = open("/proc/stat").readline().split()[1:]
    vals = [int(v) for v in fields]
    return {"total": sum(vals), "steal": vals[7] if len(vals) > 7 else 0}


def _gpu_cores() -> list[int]:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = nvml_handle(pynvml, 0)
        words = pynvml.nvmlDeviceGetCpuAffinity(h, (os.cpu_count() + 63) // 64)
        pynvml.nvmlShutdown()
        return [w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1]
    except Exception as e:  # noqa: BLE001
        return [f"error: {e}"]


def host_info() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout
        except Exception as e:  # noqa: BLE001
            return str(e)

    return {"lscpu": sh("lscpu"), "topo": sh("nvidia-smi topo -m"), "gpu_cores": _gpu_cores(),
            "governor": sh("cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1"),
            "loadavg": open("/proc/loadavg").read().strip(), "mhz": sh("grep MHz /proc/cpuinfo")}


def cpu_loop(core: int, n: int = 80) -> dict:
    os.sched_setaffinity(0, {core})
    out = []
    for _ in range(n):
        t = time.perf_counter()
        s = 0
        for i in range(300_000):
            s += i * i
        out.append((time.perf_counter() - t) * 1e3)
    return _stats(out)


def train(config: str, steps: int) -> dict:
    import gc

    import torch

    from harness.run.experiment import DataSpec
    from harness.workload import models
    from harness.workload.data import make_batch

    cores = None
    if config.startswith("pin1"):
        cores = {sorted(os.sched_getaffinity(0))[-1]}
    elif config == "numa":
        cores = {c for c in _gpu_cores() if isinstance(c, int)} or None
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(1)
    spec = models.get("qwen3-0.6b")
    model = models.build(spec, device="cuda", dtype=torch.bfloat16, attn_implementation="sdpa",
                         lora_rank=16, gradient_checkpointing=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    data = DataSpec(distribution="fixed", median_doc_len=1024, seed=0)
    batches = [make_batch(data, 2048, 1, spec.vocab_size, step=i).to("cuda") for i in range(steps)]
    warm = 5
    evs, host = [], []

    def step(b):
        out = model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i, b in enumerate(batches):
        if i == warm:
            torch.cuda.synchronize()
            if config != "pin1-gc":
                gc.collect()
                gc.freeze()
                gc.disable()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        t = time.perf_counter()
        step(b)
        host.append((time.perf_counter() - t) * 1e3)
        evs.append(e)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    gc.enable()
    ms = [a.elapsed_time(b) for a, b in zip(evs, evs[1:] + [end])][warm:]
    # syncs in one step: the sync debug mode warns on each
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(batches[0])
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(x.message).splitlines()[0][:120] for x in w]
    return {"config": config, "cores": sorted(cores) if cores else None, "step_ms": _stats(ms),
            "host_ms": _stats(host[warm:]), "syncs_per_step": len(syncs), "sync_msgs": syncs[:5],
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(train(args.child, args.steps)))
        return 0
    res = {"host": host_info(), "steal_start": _steal()}
    gpu_cores = [c for c in res["host"]["gpu_cores"] if isinstance(c, int)]
    all_cores = sorted(os.sched_getaffinity(0))
    far = [c for c in all_cores if c not in gpu_cores]
    res["cpu_loop"] = {f"core{c}": cpu_loop(c) for c in {all_cores[-1], (gpu_cores or all_cores)[0],
                                                         (far or all_cores)[0]}}
    os.sched_setaffinity(0, set(all_cores))
    res["train"] = []
    for config in ("free", "pin1", "pin1-gc", "numa", "free"):
        t0 = _steal()
        p = subprocess.run([sys.executable, __file__, "--out", "-", "--child", config,
                            "--steps", str(args.steps)], capture_output=True, text=True, timeout=240)
        t1 = _steal()
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            row = {"config": config, "error": p.stderr[-2000:]}
        row["steal_pct"] = 100 * (t1["steal"] - t0["steal"]) / max(1, t1["total"] - t0["total"])
        res["train"].append(row)
    res["steal_end"] = _steal()
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(res["host"]["lscpu"][:1500])
    print("gpu cores", res["host"]["gpu_cores"], "governor", res["host"]["governor"].strip())
    for k, v in res["cpu_loop"].items():
        print(f"cpu loop {k}: p50 {v['p50']:.2f} ms spread {v['spread']:.3f} drift {v['drift']:.3f}")
    print(f"{'config':8s} {'cores':>10s} {'step p50':>9s} {'spread':>7s} {'drift':>6s} {'host p50':>9s} "
          f"{'syncs':>5s} {'steal%':>6s}")
    for r in res["train"]:
        if "error" in r:
            print(r["config"], "ERROR", r["error"][-500:])
            continue
        s, h = r["step_ms"], r["host_ms"]
        print(f"{r['config']:8s} {str(r['cores'])[:10]:>10s} {s['p50']:9.1f} {s['spread']:7.3f} "
              f"{s['drift']:6.3f} {h['p50']:9.1f} {r['syncs_per_step']:5d} {r['steal_pct']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
