"""The peer and user variants on a real GPU: stock, Liger-Kernel and optim.enable(model) train the
same weights on the same batches, so their loss curves agree within bf16 tolerance; each is a row
of its own kind. Needs liger-kernel installed (the peers extra)."""

import pytest
import torch
from _sweep import small_gpu_experiment

from harness import results as res
from harness.run import sweep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VARIANTS = {
    "stock": {"attn_implementation": "flex_attention"},
    "liger": {"attn_implementation": "flex_attention", "stack": "liger"},
    "user": {"stack": "user"},
}


def test_stock_liger_and_user_train_alike(tmp_path):
    pytest.importorskip("liger_kernel")
    exp = small_gpu_experiment("gpu-peers", VARIANTS, seq_lens=[2048])
    summary = sweep.run(exp, tmp_path, progress=False)
    rows = {r["variant"]: r for r in res.read_rows(summary.results_path)}
    assert summary.statuses == {"ok": 3}, {v: r.get("message") for v, r in rows.items()}
    assert rows["liger"]["optim"] == {} and rows["liger"]["env"]["liger_kernel"]
    assert rows["user"]["optim"]["optim.loss"]["fused_loss"] is True
    assert rows["user"]["optim"]["optim.packing"]["packing_backend_resolved"] == "flex"  # compiled layers
    stock = rows["stock"]["loss"]
    for v in ("liger", "user"):
        for i, (a, b) in enumerate(zip(rows[v]["loss"], stock)):
            assert abs(a - b) <= 2e-2 * abs(b), (v, i, a, b)
    # both fuse the loss: neither holds the fp32 logits that set stock's peak
    assert rows["user"]["peak_allocated_gib"] < rows["stock"]["peak_allocated_gib"]
    assert rows["liger"]["peak_allocated_gib"] < rows["stock"]["peak_allocated_gib"]
    for v, r in rows.items():
        print(f"{v}: {r['step_ms']['p50']:.1f} ms, peak {r['peak_allocated_gib']:.2f} GiB, loss {r['loss'][:3]}")


def test_unsloth_runs_its_packed_path_or_its_row_says_why(tmp_path):
    # Where the unsloth extra is installed the point trains (finite losses near stock's at random
    # init, its adapters only); where it is not, a skipped row names the extra to install.
    import importlib.util

    variants = {"stock": {"attn_implementation": "flex_attention"}, "unsloth": {"stack": "unsloth"}}
    exp = small_gpu_experiment("gpu-unsloth", variants, seq_lens=[2048])
    summary = sweep.run(exp, tmp_path, progress=False)
    rows = {r["variant"]: r for r in res.read_rows(summary.results_path)}
    assert rows["stock"]["status"] == "ok", rows["stock"].get("message")
    u = rows["unsloth"]
    assert (u["role"], u["stack"]) == ("unsloth", "unsloth")
    if importlib.util.find_spec("unsloth") is None:
        assert u["status"] == "skipped" and "pip install '.[unsloth]'" in u["message"], u.get("message")
        return
    assert u["status"] == "ok", u.get("message")
    assert u["optim"] == {} and all(torch.isfinite(torch.tensor(u["loss"])))
    assert u["trainable_params"] == rows["stock"]["trainable_params"]  # LoRA on the same projections, same rank
    # random weights of one initializer, not the same draw: the first loss agrees to within a few %
    assert abs(u["loss"][0] - rows["stock"]["loss"][0]) <= 0.05 * rows["stock"]["loss"][0]


def test_the_profile_command_profiles_unsloth(tmp_path):
    # A sweep point's process imports Unsloth before torch, which it patches; the profile command
    # runs its point in its own process and must do the same, or Unsloth's build refuses to run.
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("unsloth") is None:  # found, not imported: this process has torch
        pytest.skip("the unsloth extra is not installed")
    toml = tmp_path / "u.toml"
    toml.write_text('[experiment]\nname = "u"\nmodels = ["qwen3-0.6b"]\nseq_lens = [2048]\ndevice = "cuda"\n'
                    'lora_rank = 16\nbandwidth = false\n[variants.unsloth]\nstack = "unsloth"\n')
    p = subprocess.run([sys.executable, "-m", "harness", "profile", str(toml), "--model", "qwen3-0.6b",
                        "--seq-len", "2048", "--variant", "unsloth", "--warmup", "1", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "p" / "qwen3-0.6b-2048-unsloth.summary.json").read_text())
    assert summary["phases"]["backward"]["gpu_busy_ms"] > 0 and summary["top_kernels"]


def test_the_trainer_benchs_unsloth_runs_train_stocks_weights_from_one_saved_copy(tmp_path):
    # The Trainer bench hands stock's base weights to Unsloth's loader: the first Unsloth run saves
    # them in the bench's folder, the second reads them; both first steps are stock's model (the
    # adapters' lora_B at zero), so their losses agree with stock's within bf16 tolerance, and the
    # folder is gone once the bench is.
    import importlib.util
    import os
    import tempfile
    from pathlib import Path

    from harness.bench import trainer as bench_trainer

    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("the unsloth extra is not installed")
    rows = bench_trainer.run("qwen3-0.6b", ["stock", "unsloth", "unsloth-nockpt"], max_length=2048, doc_len=1024,
                             lora_rank=16, steps=4, warmup=1, device="cuda", attn_implementation="flex_attention",
                             experts_implementation=None)
    by = {r["mode"]: r for r in rows}
    assert {m: r["status"] for m, r in by.items()} == dict.fromkeys(("stock", "unsloth", "unsloth-nockpt"), "ok"), \
        {m: r.get("error") for m, r in by.items()}
    first = by["stock"]["losses"][0]
    for mode in ("unsloth", "unsloth-nockpt"):
        assert by[mode]["weights"] == "stock", by[mode]["weights"]
        assert abs(by[mode]["losses"][0] - first) <= 1e-2 * abs(first), (mode, by[mode]["losses"][0], first)
    assert not list(Path(tempfile.gettempdir()).glob(f"{bench_trainer.WEIGHTS_PREFIX}{os.getpid()}-*"))
