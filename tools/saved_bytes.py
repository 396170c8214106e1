"""What each decoder layer keeps for backward, per token, and which code saved it: the tensors
autograd saves in one forward (``saved_tensors_hooks``; each storage once, parameters left out),
on any device, with a registry model's real shapes and random weights.

    python3 tools/saved_bytes.py --model gpt-oss-20b-2l --seq-len 256 --set moe_backend=grouped_mm \\
        --set moe_compile=true --set moe_saved=lean

Checkpointing is off, so every layer keeps what a layer whose recompute ``optim.recompute`` skips
keeps. A layer's total includes per-layer tensors that do not grow with the tokens (the LoRA
factors that the experts' GEMMs read, cast and laid out), so compare totals at one length.
What is saved is the partitioner's choice for compiled code and the kernel's for attention: the
CPU's SDPA keeps its attention probabilities, which a GPU's flash kernel does not.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

OWN = ("/optim/", "/transformers/", "/peft/", "/torch/nn/functional")


def _site() -> str:
    """The innermost three frames of optim, transformers, peft or torch.nn.functional."""
    frames = [f for f in traceback.extract_stack()[:-3] if any(k in f.filename for k in OWN)]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a name of harness.workload.models (e.g. gpt-oss-20b-2l)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens in the row (two documents)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default 64 on MoE models, else 16)")
    ap.add_argument("--stack", choices=("stock", "user"), default="user")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="SWITCH=VALUE",
                    help="an optim switch passed to optim.enable (repeatable)")
    ap.add_argument("--top", type=int, default=12, help="sites listed per layer")
    args = ap.parse_args(argv)

    import torch

    import optim
    import optim.packing
    from harness.workload import models

    spec = models.get(args.model)
    rank = args.lora_rank or (64 if spec.is_moe else 16)
    model = models.build(spec, device=args.device, dtype=torch.bfloat16, attn_implementation="sdpa",
                         experts_implementation="grouped_mm" if spec.is_moe else None, lora_rank=rank,
                         gradient_checkpointing=False)
    if args.stack == "user":
        optim.enable(model, **dict(kv.split("=", 1) for kv in args.set))
    T = args.seq_len
    meta = optim.packing.PackedMetadata.from_lengths([[T // 2, T - T // 2]])
    ids = torch.randint(0, spec.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(args.device)
    pos = meta.position_ids().to(args.device)
    labels = ids.masked_fill(pos == 0, -100)
    kw = optim.packing.packed_kwargs(meta) if args.stack == "user" else {}

    layer = [None]
    layers = (model.get_base_model() if hasattr(model, "get_base_model") else model).model.layers
    for i, mod in enumerate(layers):
        mod.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__(0, i))
        mod.register_forward_hook(lambda m, a, o: layer.__setitem__(0, None))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    by_layer: collections.Counter = collections.Counter()
    by_site: collections.Counter = collections.Counter()

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.data_ptr() not in params and key not in seen:
            seen.add(key)
            by_layer[layer[0]] += st.nbytes()
            by_site[(layer[0], _site(), str(t.dtype).replace("torch.", ""), tuple(t.shape))] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False, **kw).loss
    loss.backward()
    print(f"{args.model}, {T} tokens, {args.stack} {' '.join(args.set)}: loss {loss.item():.4f}")
    for n in sorted(by_layer, key=lambda x: (x is None, x or 0)):
        name = f"layer {n}" if n is not None else "outside the layers"
        print(f"{name}: {by_layer[n] / 2**20:.1f} MiB, {by_layer[n] / T / 1024:.1f} KiB a token")
        sites = sorted(((b, k) for k, b in by_site.items() if k[0] == n), reverse=True)[: args.top]
        for b, (_, site, dtype, shape) in sites:
            print(f"  {b / 2**20:9.2f} MiB  {dtype:9} {str(shape):22} {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
