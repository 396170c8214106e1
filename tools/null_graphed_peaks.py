"""One-off (session 7): the graphed rows measured before harness/point.py reset the peak memory
before the capture hold peaks of the replays alone, which allocate nothing, so their
``peak_allocated_gib`` is the static state, not the step's peak. Null it, with a note; their
``peak_reserved_gib`` (the graphs' pool stays reserved) and every time are unaffected.

    python3 tools/null_graphed_peaks.py results/smoke-gpu/*.jsonl results/moe/*.jsonl
"""

import json
import os
import sys

NOTE = "not measured: the peak was reset after the capture, so it held the replays alone (session 7 runs)"

for path in sys.argv[1:]:
    lines, changed = open(path).read().splitlines(), 0
    out = []
    for line in lines:
        r = json.loads(line)
        if r.get("cuda_graph") and "peak_scope" not in r and r.get("peak_allocated_gib") is not None:
            r["peak_allocated_gib"], r["peak_allocated_note"] = None, NOTE
            changed += 1
        out.append(json.dumps(r))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)
    print(f"{path}: {changed} rows")
