"""Print one line per sweep point of the given results files (a quick look at a sweep's rows).

    python3 tools/show_rows.py results/moe/nvidia-h100*.jsonl
"""

import json
import sys

for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") != "bandwidth":
            print(r["model"], r["seq_len"], r["variant"], r["status"], (r.get("step_ms") or {}).get("p50"),
                  r.get("peak_allocated_gib"), (r.get("message") or "")[:120])
