"""What the packed-input check costs a step: the host time to queue one batch's position check, and
the GPU time its kernels take, for a packed batch of the given shape.

    python3 tools/check_cost.py --seq-len 8192 --doc-len 1024

One line of JSON: the median and p20-p80 of each, over fresh position tensors (as each batch brings),
and the time to read the answers. Set them beside a step's time from tools/user_loop.py (whose
--set validate=false runs the same step without the check) measured on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _summary(xs):
    return {"p50": round(statistics.median(xs), 1), "p20": round(_pct(xs, 0.2), 1), "p80": round(_pct(xs, 0.8), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per row")
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens per packed document")
    ap.add_argument("--rows", type=int, default=1, help="rows per batch")
    ap.add_argument("--reps", type=int, default=200, help="batches checked (after 20 untimed)")
    args = ap.parse_args(argv)

    import torch

    from optim.packing import PackedMetadata, checks

    if not torch.cuda.is_available():
        print("check_cost: needs a CUDA GPU (on the CPU the check's answer is read at once)", file=sys.stderr)
        return 2
    T, d = args.seq_len, args.doc_len
    lengths = [[d] * (T // d) + ([T % d] if T % d else [])] * args.rows
    meta = PackedMetadata.from_lengths(lengths, T)
    pos = meta.position_ids().cuda()
    start = torch.arange(T, device="cuda") - pos  # each token's document start, as the metadata holds it
    batches = [pos.clone() for _ in range(args.reps + 20)]  # a new tensor per batch
    host_us, gpu_us, read_us = [], [], []
    torch.cuda.synchronize()
    for i, p in enumerate(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        checks.compare(start, p, "packing")
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        t2 = time.perf_counter()
        checks.raise_pending()
        t3 = time.perf_counter()
        if i >= 20:
            host_us.append((t1 - t0) * 1e6)
            gpu_us.append(a.elapsed_time(b) * 1e3)
            read_us.append((t3 - t2) * 1e6)
    assert checks.pending() == 0
    print(json.dumps({"seq_len": T, "doc_len": d, "rows": args.rows, "reps": args.reps,
                      "device": torch.cuda.get_device_name(), "queue_host_us": _summary(host_us),
                      "gpu_us": _summary(gpu_us), "read_host_us": _summary(read_us)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
