"""One sweep point, run inside its own fresh process: build, warm up, time, record one row.

The hot loop reads top to bottom: forward, backward, optimizer, each bracketed by a timer mark
(a CUDA event, no host sync). Losses stay on the device until the end.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from harness.measure import env as envmod
from harness.measure.timing import PhaseTimer, percentiles
from harness.run import distributed, peers, record
from harness.run.experiment import SweepPoint
from harness.run import unsloth_stack
from harness.run.stack_dumps import stacks_on_request
from harness.workload import models as model_registry
from harness.workload.data import make_batch
from harness.workload.loss import causal_lm_loss

PROGRESS_PREFIX = "@@progress "
# Test hook for point isolation: "<variant>=oom|error|crash[,...]" makes that variant's points fail
# the way a real run can (a raised CUDA OOM, an exception, or a hard process death).
FAULT_ENV = "PACKBENCH_FAULT"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("experiment asks for device 'cuda' but no CUDA GPU is visible")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _progress(**fields) -> None:
    print(PROGRESS_PREFIX + json.dumps(fields), flush=True)


SPAWNED_AT_ENV = "PACKBENCH_SPAWNED_AT"  # the launcher's time.time() when it started the point


class Timeline:
    """Where a point's wall time goes before its measured steps: ``mark(name)`` ends the phase
    in progress and starts ``name``; ``seconds()`` gives each phase's length, ``wait`` first
    (from the launcher starting the process to this point's code: imports, or the fork
    server's preload for the first point of a preloaded sweep)."""

    def __init__(self, spawned_at: float | None = None):
        self.t0 = time.perf_counter()
        self.wait = max(0.0, time.time() - spawned_at) if spawned_at else None
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict:
        out = {} if self.wait is None else {"wait": round(self.wait, 3)}
        ends = [t for _, t in self.marks[1:]] + [time.perf_counter()]
        for (name, start), end in zip(self.marks, ends):
            out[name] = round(out.get(name, 0.0) + end - start, 3)
        return out


def run_point(point: SweepPoint, timeline: Timeline | None = None) -> dict:
    """Run ``point`` and return its result row. OOM and other failures become rows too."""
    spec = model_registry.get(point.model)
    row = point.new_row()
    t0 = time.perf_counter()
    timeline = timeline or Timeline()
    try:
        _inject_fault(point)
        row.measured.update(_measure(point, spec, timeline))
        row = row.outcome("ok")
    except torch.OutOfMemoryError as e:
        row = row.outcome("oom", str(e).splitlines()[0][:500])
    except peers.PeerUnavailable as e:
        row = row.outcome("skipped", str(e)[:500])
    except Exception as e:  # noqa: BLE001 - any failure of one point is a result, not a crash
        row = row.outcome("error", f"{type(e).__name__}: {e}"[:500])
        row.measured["traceback"] = traceback.format_exc()[-4000:]
    row.measured["wall_s"] = time.perf_counter() - t0
    row.measured["setup_s"] = timeline.seconds()
    return row.to_dict()


def _inject_fault(point: SweepPoint) -> None:
    import signal

    faults = dict(item.partition("=")[::2] for item in os.environ.get(FAULT_ENV, "").split(",") if item)
    fault, _, rank = (faults.get(point.variant) or "").partition("@")  # "oom@1": rank 1 of a parallel point only
    if rank and str((distributed.world() or distributed.World(0, 1, 0)).rank) != rank:
        return
    if fault == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB (injected)")
    if fault == "error":
        raise RuntimeError("injected failure")
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        time.sleep(3600)


def _pin_cpu() -> int:
    """One core and one intra-op thread for this point's process: a host-bound step then
    competes with neither torch's worker threads nor migrations between vCPUs. The ranks of a
    parallel point each take their own core, counted from the last."""
    world = distributed.world()
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1 - (world.local_rank if world else 0) % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


@dataclass
class Prepared:
    """A point ready to train: model, optimizer and every batch already on the device."""

    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainable: list
    batches: list
    extra: list  # per-batch keyword arguments (the packing metadata a collator hands over)
    optim_applied: dict
    pinned_core: int | None
    world: distributed.World | None = None  # a parallel point's rank and group size

    def step(self, point: SweepPoint, i: int, timer: PhaseTimer | None = None, phase=None) -> torch.Tensor:
        """One training step on batch ``i``: forward, backward, optimizer (timer marks between).
        ``phase(name)``, if given, is a context manager entered around each phase (the profiler
        labels them with it)."""
        mark = timer.mark if timer is not None else (lambda: None)
        phase = phase or (lambda name: contextlib.nullcontext())
        if timer is not None:
            timer.start_step()
        with phase("forward"):
            loss = self.forward(point, i)
        mark()
        with phase("backward"):
            loss.backward()
        mark()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        mark()
        return loss.detach()

    def forward(self, point: SweepPoint, i: int) -> torch.Tensor:
        """The training loss of batch ``i``, as the point's step computes it."""
        batch = self.batches[i]
        return causal_lm_loss(self.model, batch.input_ids, batch.labels, chunked=point.loss_mode == "chunked",
                              position_ids=batch.position_ids, **self.extra[i])

    def capture(self, point: SweepPoint) -> "GraphedRun":
        """Capture this point's step as CUDA graphs (``optim.graphs``), fed from static copies of
        the batches. Where every batch has the same document lengths, optim.packing's host
        metadata is handed over and frozen at capture; where they differ, none is, and the capture
        builds the boundaries from the static position_ids on the device, so each replay reads
        its own batch's (flex and sdpa; varlen refuses)."""
        from optim import graphs

        graphs.check_capturable(self.model, self.optimizer)
        first = self.batches[0]
        static = {"input_ids": first.input_ids.clone(), "labels": first.labels.clone(),
                  "position_ids": first.position_ids.clone()}
        same = all(b.lengths == first.lengths for b in self.batches)
        extra = self.extra[0] if same else {}

        def forward_loss():
            return causal_lm_loss(self.model, static["input_ids"], static["labels"],
                                  chunked=point.loss_mode == "chunked", position_ids=static["position_ids"], **extra)

        step = graphs.GraphedStep(forward_loss, self.optimizer)
        step.capture()
        return GraphedRun(step, static, self.batches)


@dataclass
class GraphedRun:
    """A captured step: each call refills the static inputs from batch ``i`` (untimed), then
    replays forward, backward and optimizer with a timer mark after each."""

    step: object
    static: dict
    batches: list

    def __call__(self, i: int, timer: PhaseTimer) -> torch.Tensor:
        batch = self.batches[i]
        for name, buf in self.static.items():
            buf.copy_(getattr(batch, name))
        timer.start_step()
        loss = self.step.forward()
        timer.mark()
        self.step.backward()
        timer.mark()
        self.step.optimizer_step()
        timer.mark()
        return loss.clone()


def prepare(point: SweepPoint, spec, n_batches: int, on_phase=lambda phase: None, after_build=None) -> Prepared:
    """Build the point's model (optim switches applied), its AdamW and ``n_batches`` batches;
    ``on_phase(name)`` is told what it starts (a sweep point reports it as progress);
    ``after_build(model)``, if given, edits the built model before the optim switches apply."""
    pinned_core = _pin_cpu() if point.pin_cpu else None
    device = resolve_device(point.device)
    world = None
    if point.parallel:
        world, device = distributed.setup(device)
    dtype = DTYPES[point.dtype]
    sw = point.switches
    if point.cuda_graph and device.type != "cuda":
        raise RuntimeError(f"variant {point.variant!r} sets cuda_graph = true, which needs a CUDA device; "
                           f"this point runs on {device.type}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    before_lora = peers.liger_patch(device) if point.stack == "liger" else None
    on_phase("building the model")
    if point.stack == "unsloth":
        model = unsloth_stack.build(spec, device=device, dtype=dtype, lora_rank=point.lora_rank,
                                    max_seq_length=point.seq_len,
                                    gradient_checkpointing=sw["gradient_checkpointing"], seed=point.data.seed,
                                    batch_size=point.batch_size)
    else:
        model = _build(point, spec, device, dtype, before_lora)
    if after_build is not None:
        after_build(model)
    on_phase("enabling optim")
    optim_applied = _enable_optim(model, sw, point.stack)
    if world is not None:  # as a user's FSDP2 script does: the model as enabled, then sharded
        on_phase("sharding")
        distributed.shard(model)
    # after enable(): a module may freeze or unfreeze parameters (the MoE router)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=device.type == "cuda" and world is None,
                                  capturable=point.cuda_graph)
    batches = [
        make_batch(point.data, point.seq_len, point.batch_size, spec.vocab_size,
                   step=world.batch_step(i) if world is not None else i).to(device)
        for i in range(n_batches)
    ]
    # What a packing collator hands the model besides the tensors: the document lengths it
    # already knows on the host, so no layer has to rediscover them from position_ids.
    extra = [unsloth_stack.packed_kwargs(b) if point.stack == "unsloth" else _packing_kwargs(b, optim_applied) for b in batches]
    on_phase("first step")
    return Prepared(device, dtype, model, optimizer, trainable, batches, extra, optim_applied, pinned_core, world)


def _build(point: SweepPoint, spec, device, dtype, before_lora):
    """The harness's own build: transformers + peft, Liger-Kernel's patches first where given."""
    sw = point.switches
    return model_registry.build(
        spec,
        device=device,
        dtype=dtype,
        attn_implementation=sw["attn_implementation"],
        experts_implementation=sw.get("experts_implementation"),
        lora_rank=point.lora_rank,
        gradient_checkpointing=sw["gradient_checkpointing"],
        seed=point.data.seed,
        lora_dtype=point.lora_dtype,
        # a captured step cannot read the RNG state; check_capturable refuses any dropout it would need
        checkpoint_preserve_rng=not point.cuda_graph,
        before_lora=before_lora,
    )


_PHASE_KEYS = {"building the model": "build", "enabling optim": "enable", "sharding": "shard",
               "first step": "warmup", "capturing the step as CUDA graphs": "capture"}


def compiled_graphs() -> int:
    """How many graphs torch.compile (dynamo) has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _measure(point: SweepPoint, spec, timeline: Timeline) -> dict:
    n_steps = point.warmup_steps + point.measured_steps

    def on_phase(phase: str) -> None:
        timeline.mark(_PHASE_KEYS.get(phase, phase))
        _progress(phase=phase)

    run = prepare(point, spec, n_steps, on_phase=on_phase)
    device, dtype, model, trainable = run.device, run.dtype, run.model, run.trainable
    optim_applied, pinned_core = run.optim_applied, run.pinned_core
    batches = run.batches
    timer = PhaseTimer(("forward", "backward", "optimizer"), device)
    losses = []
    warmup_losses: list[float] = []
    last_end = None
    graphed = None
    compiles: list[int] = []  # graphs torch.compile made in each measured step
    compiled_before_measured = None
    collections_before = [g["collections"] for g in gc.get_stats()]
    frozen = False  # the collector, frozen and disabled for the measured steps: undone however they end
    try:
        for i in range(n_steps):
            if i == point.warmup_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                if point.cuda_graph:
                    # Peaks from here on: a replay allocates nothing, so the step's tensors are
                    # counted when the capture (and its eager warm-up) allocates them.
                    on_phase("capturing the step as CUDA graphs")
                    graphed = run.capture(point)
                timeline.mark("measured")
                timer.discard()
                warmup_losses = torch.stack(losses).float().cpu().tolist() if losses else []
                losses.clear()
                if "optim.packing" in optim_applied:
                    from optim import packing

                    packing.reset_counters()  # counted over the measured steps only
                if not point.collector:
                    # A gen-2 collection in a host-bound step stalls the GPU queue for ~0.2 s; keep
                    # the collector out of the measured region, as pyperf and timeit do. "as_run"
                    # leaves it as the stack left it: what a user's own loop pays.
                    gc.collect()
                    gc.freeze()
                    gc.disable()
                    frozen = True
                collections_before = [g["collections"] for g in gc.get_stats()]
                compiled_before_measured = compiled_graphs()
            before = compiled_graphs()
            losses.append(graphed(i, timer) if graphed is not None else run.step(point, i, timer))
            if i >= point.warmup_steps:
                compiles.append(compiled_graphs() - before)
            last_end = _report_progress(i, n_steps, timer, last_end)
        gc_collections = [g["collections"] - b for g, b in zip(gc.get_stats(), collections_before)]
    finally:
        if frozen:
            gc.enable()
            gc.unfreeze()
    times = timer.results_ms()
    optim_stats = record.optim_stats(model, optim_applied)
    losses_f = torch.stack(losses).float().cpu().tolist()
    measured = batches[point.warmup_steps:]
    out = {
        **record.memory(device),
        **record.throughput(point, times),
        **record.flops(point, spec, model, measured, times, device),
        "forward_ms": percentiles(times["forward"]),
        "backward_ms": percentiles(times["backward"]),
        "optimizer_ms": percentiles(times["optimizer"]),
        "step_ms": percentiles(times["step"]),
        "loss": losses_f,
        "num_docs": [b.num_docs for b in measured],
        "sum_len": [b.sum_len for b in measured],
        "sum_len_sq": [b.sum_len_sq for b in measured],
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
        "device_type": device.type,
        "attn_implementation_used": model.config._attn_implementation,
        "optim": record.optim_after(model, optim_applied),
        # every optim switch of the modules applied, as it resolved (OPTIM_* variables included)
        "switches_resolved": {k: v for m in optim_applied.values() for k, v in m.get("resolved", {}).items()},
        "pinned_core": pinned_core,
        **optim_stats,
        "dtype_used": str(dtype).replace("torch.", ""),
        "graph_capture_ms": graphed.step.capture_ms if graphed is not None else None,
        # torch.compile's graphs: made before the measured steps, and in each measured step (a
        # step that compiles is timed with its compile: its median is not the steady state)
        "compiled_graphs_warmup": compiled_before_measured,
        "compiled_graphs_per_step": compiles,
        "gc_collections": gc_collections,
        # what the peaks span: the measured steps, or (graphed) the capture and the replays
        "peak_scope": "capture and replays" if graphed is not None else "measured steps",
        "warmup_losses": warmup_losses,  # the first step's loss included: numerics from the first step
    }
    if run.world is not None:  # after the measured steps: one more, profiled, for its collectives
        out.update(distributed.collective_ms(lambda: run.step(point, n_steps - 1)))
        out.update(record.across_ranks(run.world, out, warmup_losses))
    return out


def _enable_optim(model, switches: dict, stack: str = "") -> dict:
    """``optim.enable`` as the variant's stack says (``harness.run.peers``): restricted to the
    modules the variant configures (stock variants configure none), or, for ``stack = "user"``,
    the plain call with every default, so a sweep measures exactly what that call gives. Returns
    ``optim.enabled(model)``: per module applied, what it changed and the value each of its
    switches resolved to (the variant's setting, else OPTIM_<NAME>, else the default)."""
    from harness.variant_keys import optim_settings

    return peers.enable(model, stack, optim_settings(switches))


def _packing_kwargs(batch, optim_applied: dict) -> dict:
    settings = optim_applied.get("optim.packing")
    if not settings or settings["resolved"]["packing_backend"] == "off":
        return {}
    from optim import packing

    return packing.packed_kwargs(packing.PackedMetadata.from_lengths(batch.lengths))


def _report_progress(i: int, n_steps: int, timer: PhaseTimer, last_end):
    """Emit the latest finished step time without forcing a sync: a CUDA event is only read
    once ``query()`` says the device has passed it."""
    marks = timer._steps[-1]
    if not timer.cuda:
        _progress(step=i + 1, of=n_steps, last_step_ms=(marks[-1] - marks[0]) * 1e3)
        return None
    prev = last_end
    if prev is not None and prev[1].query():
        _progress(step=i, of=n_steps, last_step_ms=prev[0].elapsed_time(prev[1]))
    else:
        _progress(step=i + 1, of=n_steps, last_step_ms=None)
    return (marks[0], marks[-1])


def _die_with_parent() -> None:
    """Linux: SIGKILL this point when the sweep process dies, however it dies. The point runs in
    its own session (so a timeout can kill its whole group), which also puts it out of reach of a
    signal sent to the sweep's group: a sweep killed by ``timeout`` once left its point running,
    holding 70 GiB of GPU memory, and every later point ran out of memory."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the prctl took effect
        os._exit(1)


def main(spec_path: str, out_path: str) -> int:
    """Entry of the child process: read the point, run it, write the row as JSON."""
    _die_with_parent()
    stacks_on_request()
    with open(spec_path) as f:
        point = SweepPoint.from_json(f.read())
    spawned_at = os.environ.get(SPAWNED_AT_ENV)
    world = distributed.world() if point.parallel else None
    row = run_point(point, Timeline(float(spawned_at) if spawned_at else None))
    failed = row["status"] != "ok"
    if world is not None and world.rank != 0:
        if not failed:  # rank 0 writes the point's row; wait until it has (see below)
            distributed.finish()
            return 0
        out_path = rank_result_path(out_path, world.rank)
        row["message"] = f"rank {world.rank}: {row['message']}"
    row["env"] = envmod.collect()
    tmp = f"{out_path}.tmp"  # whole or absent: a process that dies mid-write leaves no half row
    with open(tmp, "w") as f:
        json.dump(row, f, default=str)
    os.replace(tmp, out_path)
    if world is not None:
        if failed:  # exit at once: torchrun then stops the ranks still waiting in a collective
            sys.stdout.flush()
            os._exit(1)
        # The other ranks leave only after this row is on disk. They used to tear the group down
        # while rank 0 was still collecting its environment; one of them then died in gloo's
        # teardown (std::terminate, SIGSEGV), torchrun killed rank 0 before it wrote, and a point
        # that had finished was recorded as "exited with code 1 without a result".
        distributed.finish()
    return 0


def rank_result_path(out_path: str, rank: int) -> str:
    """Where rank ``rank`` (> 0) of a parallel point writes its row when it fails."""
    return f"{out_path}.rank{rank}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
