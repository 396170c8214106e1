"""Where a step's memory peak goes, read from the CUDA caching allocator's memory history
(``torch.cuda.memory._record_memory_history``): its alloc and free events replayed in order, the
most bytes live at once found, and the blocks live then grouped by the code that allocated them.

The replay counts a block from its ``alloc`` to its ``free_requested``: the tensor's release, where
the allocator's ``allocated_bytes`` falls too (a block used on another stream, as offload's copies
are, goes back to the pool later, at ``free_completed``: the replay does not count that wait). The
history records each request's size; the replay rounds it up to the allocator's 512 bytes, but a
large block's unsplit remainder it cannot see, so it can read a little under the allocator's
peak. Blocks allocated before the history started are not in it: the replay is of what the
recorded step allocated, above what it started with. Marker blocks split the step into phases
(``phase_marker``): allocated and freed at once, in order, from the bench's ``mark``; they are not
counted.
"""

from __future__ import annotations

from collections import defaultdict

MARK = 1_000_448  # a marker block's size; a tensor may have it too, so a marker is also known by its frame and order
MARK_FRAME = "mark"  # the function that allocates the markers (harness.bench.memory)
ROUND = 512  # the caching allocator's smallest block: every request is rounded up to a multiple
# Frames worth naming: the code a reader can act on (the model, the adapters, optim, the peers'
# kernels) and the graphs inductor generated for it; torch's own frames in between are skipped.
KEEP = ("/optim/", "/transformers/", "/peft/", "/harness/", "torchinductor", "/unsloth", "/liger_kernel/",
        "torch/nn/functional", "torch/utils/checkpoint", "/ATen/native/")
# ``/ATen/native/``: with C++ stacks recorded (``harness.bench.memory --stacks all``), the operator
# that allocated inside an eager kernel or the autograd engine, e.g. FlashAttention's backward.
# Release wheels symbolize C++ frames without a file ("??"): those are known by the function's
# namespace instead, the allocator's factory functions (``at::native::empty_cuda``...) left aside.
CPP_KEEP = ("at::native::", "pytorch_flash::", "at::cuda::")
CPP_FACTORY = ("empty", "zeros", "ones", "full", "resize")


def _cpp_operator(f: dict) -> str | None:
    """A C++ frame's operator (its function without the signature) where it is one worth naming."""
    func = str(f.get("name", "")).split("(", 1)[0]
    if not func.startswith(CPP_KEEP):
        return None
    base = func.rsplit("::", 1)[-1].lstrip("_")
    return None if base.startswith(CPP_FACTORY) else func


def phase_marker(k: int) -> int:
    """The size of phase ``k``'s marker block."""
    return MARK + 512 * k


def _is_marker(e: dict, k: int) -> bool:
    """Marker ``k``: its size, allocated by ``MARK_FRAME`` where the event has frames."""
    frames = e.get("frames") or []
    return (e.get("action") == "alloc" and int(e.get("size", 0)) == phase_marker(k)
            and (not frames or any(f.get("name") == MARK_FRAME for f in frames)))


def site(frames: list[dict], depth: int = 3) -> str:
    """The allocating code: the innermost ``depth`` frames worth naming (``KEEP``), innermost first,
    each as path:line:function with the path from the package on; "(no frame)" where none is."""
    out = []
    for f in frames:
        name = str(f.get("filename", ""))
        if "/ATen/native/" not in name and (op := _cpp_operator(f)):  # a release build's C++ frame
            out.append(f"aten {op}")
        elif any(k in name for k in KEEP):
            short = name.split("/site-packages/")[-1]
            for root in ("/optim/", "/harness/"):  # a source checkout: from the package on
                if root in short:
                    short = root[1:] + short.split(root, 1)[1]
            func = str(f.get("name"))
            if "torchinductor" in short:
                short = "inductor-generated " + short.rsplit("/", 1)[-1]
            elif "/ATen/native/" in name:  # a C++ frame: its file, and its function without the signature
                short, func = "aten " + short.rsplit("/", 1)[-1], func.split("(", 1)[0]
            out.append(f"{short}:{f.get('line')}:{func}")
        if len(out) == depth:
            break
    return " < ".join(out) or "(no frame)"


def replay(events: list[dict], phases: tuple[str, ...] = (), depth: int = 3) -> dict:
    """The recorded step's peak: ``peak_bytes`` (live at once, above the start), ``peak_event``
    (its index), ``phase`` (the last marker's name before it, None without markers), ``groups``
    (the blocks live at the peak by ``site``: ``site``, ``bytes``, ``blocks``, most bytes first)
    and ``events``. ``phases[k]`` names marker k (``phase_marker``)."""
    marks: dict[int, str] = {}  # the events that are markers, and the phase each starts
    for i, e in enumerate(events):
        if len(marks) < len(phases) and _is_marker(e, len(marks)):
            marks[i] = phases[len(marks)]
    live: dict[int, int] = {}
    cur = best = 0
    best_i, phase, best_phase = -1, None, None
    for i, e in enumerate(events):
        action, size = e.get("action"), -(-int(e.get("size", 0)) // ROUND) * ROUND
        if i in marks:
            phase = marks[i]
            continue
        if action == "alloc":
            live[e["addr"]] = size
            cur += size
            if cur > best:
                best, best_i, best_phase = cur, i, phase
        elif action == "free_requested" and e.get("addr") in live:
            cur -= live.pop(e["addr"])
    at: dict[int, tuple[int, str]] = {}
    for i, e in enumerate(events[:best_i + 1]):  # the blocks live at the peak, with their sites
        action, size = e.get("action"), -(-int(e.get("size", 0)) // ROUND) * ROUND
        if action == "alloc" and i not in marks:
            at[e["addr"]] = (size, site(e.get("frames") or [], depth))
        elif action == "free_requested":
            at.pop(e.get("addr"), None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at.values():
        groups[where][0] += size
        groups[where][1] += 1
    return {"peak_bytes": best, "peak_event": best_i, "phase": best_phase, "events": len(events),
            "groups": [{"site": s, "bytes": b, "blocks": n}
                       for s, (b, n) in sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))]}
