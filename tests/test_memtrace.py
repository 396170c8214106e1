"""harness.measure.memtrace and harness.bench.memory: a step's peak replayed from the allocator's
history, named by its allocating code, and the bench's rows and report table."""

import json

import pytest
import torch

from harness import results as res
from harness.bench import memory as bench
from harness.measure import memtrace
from harness.report import memory as report

MIB = 2**20
OPTIM = {"filename": "/src/optim/lora.py", "line": 77, "name": "lora_forward"}
MLP = {"filename": "/src/optim/mlp.py", "line": 90, "name": "forward"}
TORCH = {"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "line": 1, "name": "__torch_function__"}
INDUCTOR = {"filename": "/tmp/torchinductor_root/5q/c5qzle5.py", "line": 420, "name": "call"}
HF = {"filename": "/usr/lib/python3/site-packages/transformers/models/llama/modeling_llama.py", "line": 268,
      "name": "forward"}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr, size, completed=False):
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": size}


MARKER = {"filename": "/src/harness/bench/memory.py", "line": 70, "name": "mark"}


def _mark(k):
    size = memtrace.phase_marker(k)
    return [_alloc(999 + k, size, TORCH, MARKER), _free(999 + k, size), _free(999 + k, size, True)]


def test_site_names_the_innermost_frames_worth_acting_on():
    assert memtrace.site([TORCH, INDUCTOR, TORCH, OPTIM, HF, MLP]) == (
        "inductor-generated c5qzle5.py:420:call < optim/lora.py:77:lora_forward < "
        "transformers/models/llama/modeling_llama.py:268:forward")
    assert memtrace.site([TORCH, OPTIM], depth=1) == "optim/lora.py:77:lora_forward"
    assert memtrace.site([TORCH]) == memtrace.site([]) == "(no frame)"
    # with C++ stacks: the operator's file and function, its signature and the engine's frames dropped
    flash = {"filename": "/pytorch/aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp", "line": 1021,
             "name": "pytorch_flash::mha_bwd(at::Tensor const&, at::Tensor const&, float, bool)"}
    engine = {"filename": "/pytorch/torch/csrc/autograd/engine.cpp", "line": 1100, "name": "torch::autograd::Engine::evaluate_function"}
    assert memtrace.site([flash, engine, OPTIM], depth=2) == "aten flash_api.cpp:1021:pytorch_flash::mha_bwd < optim/lora.py:77:lora_forward"
    # a release wheel's C++ frames have no file ("??"): named by the operator, the allocator's
    # factory function (the innermost) and the unwinder left aside
    def cpp(name):
        return {"filename": "??", "line": 0, "name": name}

    frames = [cpp("torch::unwind::unwind()"), cpp("at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>)"),
              cpp("at::native::_empty_affine_quantized(long)"),
              cpp("pytorch_flash::mha_bwd(at::Tensor const&, at::Tensor const&, float, bool)"),
              cpp("at::native::_flash_attention_backward(at::Tensor const&)"), cpp("torch::autograd::Engine::thread_main()"),
              OPTIM]
    assert memtrace.site(frames) == ("aten pytorch_flash::mha_bwd < aten at::native::_flash_attention_backward < "
                                     "optim/lora.py:77:lora_forward")


def test_replay_finds_the_peak_its_phase_and_the_blocks_live_then():
    events = [
        *_mark(0),
        _free(1, 64 * MIB), _free(1, 64 * MIB, True),  # a block of the step's start: not in the replay
        _alloc(10, 100 * MIB, OPTIM), _alloc(11, 300 * MIB, INDUCTOR, OPTIM), _alloc(12, 300 * MIB, INDUCTOR, OPTIM),
        _free(11, 300 * MIB), _free(12, 300 * MIB),  # released: free_completed may come much later
        *_mark(1),
        _alloc(13, 200 * MIB, MLP), _alloc(14, 50 * MIB, MLP), _alloc(15, 520 * MIB, MLP),  # 870: the peak
        _free(11, 300 * MIB, True), _free(12, 300 * MIB, True),  # completed late: counted once, at the request
        _free(15, 520 * MIB), _free(15, 520 * MIB, True),
        *_mark(2), _alloc(16, 10 * MIB, OPTIM),
    ]
    out = memtrace.replay(events, ("forward", "backward", "optimizer"))
    assert out["peak_bytes"] == 870 * MIB and out["phase"] == "backward" and out["events"] == len(events)
    assert out["peak_event"] == next(i for i, e in enumerate(events) if e.get("addr") == 15)
    assert out["groups"] == [{"site": "optim/mlp.py:90:forward", "bytes": 770 * MIB, "blocks": 3},
                             {"site": "optim/lora.py:77:lora_forward", "bytes": 100 * MIB, "blocks": 1}]
    assert sum(g["bytes"] for g in out["groups"]) == out["peak_bytes"]
    # without phase names no phase is named; a marker, freed at once, adds nothing to the peak
    plain = memtrace.replay(events)
    assert plain["phase"] is None and plain["peak_bytes"] == out["peak_bytes"]


def test_a_tensor_of_a_markers_size_is_a_tensor_and_sizes_round_to_the_allocators_blocks():
    """A marker is its size, allocated by the bench's mark, in order: a tensor the model makes at
    that size, or a marker's size out of order, counts as a tensor. Requests round up to 512 bytes."""
    m0, m1 = memtrace.phase_marker(0), memtrace.phase_marker(1)
    events = [_alloc(1, m1, TORCH, MARKER), _free(1, m1),  # marker 1 before marker 0: not a marker
              *_mark(0),
              _alloc(2, m1, MLP),  # a tensor of marker 1's size, from the model
              _alloc(3, 100, OPTIM),  # 100 bytes: a 512-byte block
              *_mark(1)]
    out = memtrace.replay(events, ("forward", "backward"))
    assert out["phase"] == "forward" and out["peak_bytes"] == m1 + 512
    assert {g["site"]: g["bytes"] for g in out["groups"]} == {"optim/mlp.py:90:forward": m1,
                                                              "optim/lora.py:77:lora_forward": 512}
    assert m0 % 512 == 0


def test_the_bench_reads_its_switches_and_refuses_bad_arguments(capsys):
    assert bench.parse_settings(["recompute=all", "mlp_chunk=4096", "offload_profile=true", "offload=double"]) == {
        "recompute": "all", "mlp_chunk": 4096, "offload_profile": True, "offload": "double"}
    with pytest.raises(ValueError, match="key=value"):
        bench.parse_settings(["mlp_chunk"])
    for argv, msg in ((["--stack", "stock", "--set", "recompute=all"], "needs --stack user"),
                      (["--seq-len", "1000", "--doc-len", "300"], "does not divide"),
                      (["--set", "=4"], "key=value"), (["--stacks", "cpp"], "invalid choice")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert msg in capsys.readouterr().err
    b = bench.batch(8, 4, 100, "cpu")
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] and b["labels"] is b["input_ids"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench runs (tests/test_gpu_memory.py)")
def test_without_a_gpu_the_bench_says_it_needs_one(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--model", "qwen3-0.6b-tiny", "--seq-len", "64", "--results", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing written


def _row(settings, peak=2.5, status="ok"):
    return {"kind": "memory_peak", "model": "llama-3.1-8b", "seq_len": 65536, "doc_len": 0, "stack": "user",
            "settings": settings, "status": status, "start_gib": 16.52, "step_peak_gib": peak,
            "replayed_peak_gib": peak - 0.01, "peak_kib_per_token": 40.0, "phase": "backward",
            "groups": [{"site": "optim/mlp.py:90:forward", "bytes": 2**30, "blocks": 3, "gib": 1.0,
                        "kib_per_token": 16.0}], "message": "" if status == "ok" else "CUDA out of memory."}


def test_rows_of_other_switches_are_kept_apart_and_the_report_shows_each(tmp_path):
    env = {"device_name": "NVIDIA H100 80GB HBM3"}
    res.write_bench_rows(tmp_path, "context", [_row({"recompute": "all"})], env=env, command="a")
    res.write_bench_rows(tmp_path, "context", [_row({"recompute": "all", "mlp_chunk": 4096}, 1.5)], env=env, command="b")
    res.write_bench_rows(tmp_path, "context", [_row({"recompute": "all"}, 2.0)], env=env, command="c")  # replaces "a"
    path = res.results_path(tmp_path, "context", "nvidia-h100-80gb-hbm3")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["command"] for r in rows) == ["b", "c"]
    text = report.bench_tables(rows + [_row({"offload": "double"}, status="oom")], {})
    assert ("**llama-3.1-8b, 65536 tokens, one document, `optim.enable(model, recompute=all)`**: the step's peak "
            "is 2.00 GiB above its start of 16.52 GiB (the allocator's); replayed 1.99 GiB, 40.0 KiB a token, "
            "in the backward.") in text
    assert "| `optim/mlp.py:90:forward` | 1.000 | 16.0 | 3 |" in text
    assert "`optim.enable(model, mlp_chunk=4096, recompute=all)`" in text
    assert "`optim.enable(model, offload=double)`**\n\noom: CUDA out of memory." in text
    assert report.bench_tables([{"kind": "attention_kernel"}], {}) == ""
