"""harness.run.profile: per-phase GPU busy time, launches and syncs from a trace; the CLI on CPU."""

import json

import pytest

from harness import cli
from harness.run.profile import analyze


def test_analyze_busy_launches_syncs_per_phase():
    X = lambda c=None, **kw: {"ph": "X", **kw, **({"args": {"correlation": c}} if c else {})}  # noqa: E731
    ev = [  # chrome-trace events, ts/dur in µs; kernels find their launch by correlation id
        X(cat="user_annotation", name="phase:forward", ts=0, dur=100),
        X(1, cat="cuda_runtime", name="cudaLaunchKernel", ts=5, dur=2),
        X(2, cat="cuda_runtime", name="cudaLaunchKernel", ts=50, dur=2),
        X(3, cat="cuda_runtime", name="cudaLaunchKernel", ts=60, dur=2),
        X(cat="cuda_runtime", name="cudaStreamSynchronize", ts=70, dur=20),
        X(4, cat="cuda_runtime", name="cudaLaunchKernel", ts=150, dur=2),  # after the phase
        X(1, cat="kernel", name="gemm", ts=10, dur=50),
        X(2, cat="kernel", name="gemm", ts=40, dur=50),  # overlaps the first: counted once
        X(3, cat="kernel", name="softmax", ts=190, dur=10),  # span [10, 200): 90 of 190 busy
        X(4, cat="kernel", name="softmax", ts=400, dur=20),  # launched outside the phase
    ]
    s = analyze(ev)
    f = s["phases"]["forward"]
    assert f["gpu_span_ms"] == pytest.approx(0.19) and f["cpu_span_ms"] == pytest.approx(0.1)
    assert f["gpu_busy_ms"] == pytest.approx(0.09)
    assert f["gpu_busy_pct"] == pytest.approx(100 * 90 / 190)
    assert f["kernels"] == 3 and f["launches"] == 3 and f["host_syncs"] == 1
    assert s["phases"]["backward"]["gpu_busy_pct"] is None
    assert s["top_kernels"][0]["name"] == "gemm" and s["top_kernels"][0]["count"] == 2
    assert s["kernel_ms_total"] == pytest.approx(0.13)


def test_profile_cli_on_a_tiny_model(tmp_path, capsys):
    rc = cli.main(["profile", "experiments/smoke-cpu.toml", "--model", "llama-3.2-1b-tiny", "--seq-len", "256",
                   "--variant", "optim", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "forward" in out and "backward" in out
    # a CPU run says what it shows, and no GPU columns or kernel list of zeros
    assert "CPU run: host times only" in out and "top kernels" not in out and "gpu ms" not in out
    summary = json.loads((tmp_path / "llama-3.2-1b-tiny-256-optim.summary.json").read_text())
    assert summary["phases"]["forward"]["cpu_span_ms"] > 0
    from harness.measure.env import code_sha

    assert summary["env"]["code_sha"] == code_sha() and "git_sha" in summary["env"]  # what measured it
    assert (tmp_path / "llama-3.2-1b-tiny-256-optim.cpu.txt").read_text().strip()


def test_profile_cli_rejects_an_unknown_variant(tmp_path, capsys):
    rc = cli.main(["profile", "experiments/smoke-cpu.toml", "--model", "llama-3.2-1b-tiny", "--seq-len", "256",
                   "--variant", "nope", "--out", str(tmp_path)])
    assert rc == 2 and "nope" in capsys.readouterr().err


def test_profile_cli_says_in_one_line_why_a_peer_cannot_run(tmp_path):
    # A peer that cannot run here (Unsloth on a CPU point) is one line on stderr and exit 1, not a
    # traceback; on a GPU, test_gpu_peers profiles Unsloth itself.
    import subprocess
    import sys

    toml = tmp_path / "u.toml"
    toml.write_text('[experiment]\nname = "u"\nmodels = ["llama-3.2-1b-tiny"]\nseq_lens = [256]\ndevice = "cpu"\n'
                    'bandwidth = false\n[variants.unsloth]\nstack = "unsloth"\n')
    p = subprocess.run([sys.executable, "-m", "harness", "profile", str(toml), "--model", "llama-3.2-1b-tiny",
                        "--seq-len", "256", "--variant", "unsloth", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "not imported first" not in p.stderr
    assert p.stderr == "error: unsloth: Unsloth needs a CUDA GPU; this point runs on cpu\n"
