"""harness.bench.attention on CPU: the masked and causal SDPA kernels (flex and varlen need CUDA),
each layout measured once, stored as packing bench rows, and the report's table built from them."""

from __future__ import annotations

from harness import results as res
from harness.bench import attention
from harness.report.packing import attention_kernel_table


def test_each_layout_once_causal_only_on_whole_rows_and_the_table(tmp_path):
    attention.main(["--model", "llama-3.2-1b-tiny", "--lengths", "64", "128", "--doc-lens", "0", "64", "32",
                    "--warmup", "1", "--repeats", "2", "--results", str(tmp_path)])
    rows = res.read_rows(res.results_path(tmp_path, "packing", "cpu"))
    layouts = [(r["seq_len"], r["doc_len"], r["backend"]) for r in rows]
    assert len(layouts) == len(set(layouts))  # doc length 0 is the row's: 64 at 64 is measured once
    assert sorted(layouts) == sorted([
        (64, 64, "sdpa"), (64, 64, "sdpa-causal"), (64, 64, "sdpa-causal-split"), (64, 32, "sdpa"),
        (128, 128, "sdpa"), (128, 128, "sdpa-causal"), (128, 128, "sdpa-causal-split"), (128, 64, "sdpa"),
        (128, 32, "sdpa")])
    assert all(r["status"] == "ok" and r["forward_backward_ms"]["p50"] > 0 for r in rows)
    assert {r["num_docs"] for r in rows if r["seq_len"] == 128} == {1, 2, 4}
    table = attention_kernel_table(rows)
    # a whole row: causal SDPA's lead over the fastest packed kernel is blank without flex or varlen
    assert "| llama-3.2-1b-tiny |" in table and "| 128 | 32 |" in table
