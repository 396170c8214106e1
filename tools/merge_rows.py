#!/usr/bin/env python3
# usage: python3 tools/merge_rows.py results/<exp>/<gpu>.jsonl /work/.device/N/<exp>/<gpu>.jsonl ...
"""Merge device jsonl files (each = the committed file + that call's rows) into the committed file:
step rows replaced by point_id in call order; bandwidth rows are those of the last call (a sweep
replaces them)."""
import json, sys
dst, srcs = sys.argv[1], sys.argv[2:]
def load(p): return [json.loads(l) for l in open(p)]
base = load(dst)
key = lambda r: (r.get("point_id"), r.get("repeat"))
steps = {key(r): r for r in base if r.get("kind") != "bandwidth"}
order = list(steps)
basej = {k: json.dumps(v, sort_keys=True) for k, v in steps.items()}
bw = [r for r in base if r.get("kind") == "bandwidth"]
for s in srcs:
    rows = load(s)
    b = [r for r in rows if r.get("kind") == "bandwidth"]
    if b: bw = b
    for r in rows:
        if r.get("kind") == "bandwidth": continue
        k = key(r)
        if basej.get(k) == json.dumps(r, sort_keys=True): continue
        if k not in steps: order.append(k)
        steps[k] = r
        print("new/changed:", r.get("model"), r.get("seq_len"), r.get("variant"), r.get("status"))
with open(dst, "w") as f:
    for r in [steps[k] for k in order] + bw: f.write(json.dumps(r) + "\n")
