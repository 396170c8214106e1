"""Linear + cross-entropy kernels (``harness.bench.loss``): time, peak memory and error of each,
per lm_head shape and weight mode, against the stock full-logits loss of the same run."""

from __future__ import annotations

from harness.report.fmt import DASH
from harness.report import fmt
from harness.report.moe import rows_of_kind

ORDER = ["stock", "liger", "cce", "cce-filtered", "optim-compiled", "optim-eager"]


def _rank(kernel: str) -> int:
    return ORDER.index(kernel) if kernel in ORDER else len(ORDER)


def _err(x) -> str:
    return DASH if fmt.number(x) is None else f"{fmt.number(x):.1e}"


def loss_tables(rows: list[dict]) -> str:
    """One table per (shape, weight mode): every kernel's time, speedup over stock, peak memory
    above its inputs and error against fp32 ("" without ``loss_kernel`` rows)."""
    found = rows_of_kind(rows, "loss_kernel")
    if not found:
        return ""
    groups: dict[tuple, list[dict]] = {}
    for r in found:
        groups.setdefault((r.get("model"), r.get("mode")), []).append(r)
    parts = ["#### Linear + cross-entropy kernels",
             ("Forward + backward of the loss alone on bf16 inputs (`python -m harness.bench.loss`): "
             "median [p20–p80] of CUDA-event timings after warm-up; peak = memory the call held above "
             "its inputs; errors = relative to an fp32 computation of the same inputs (loss, and the "
             "norm of the hidden-state and weight gradient differences). A kernel is as exact as stock "
             "when its errors are the size of stock's. frozen = lm_head frozen (LoRA), trained = "
             "lm_head trained too.")]
    for (model, mode), group in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        first = group[0]
        stock = next((fmt.number(r.get("ms")) for r in group if r.get("backend") == "stock" and r.get("status") == "ok"), None)
        body = []
        for r in sorted(group, key=lambda r: _rank(str(r.get("backend")))):
            if r.get("status") != "ok":
                body.append([r.get("backend"), f"{r.get('status')}: {r.get('error', '')}", DASH, DASH, DASH, DASH, DASH])
                continue
            ms = fmt.number(r.get("ms"))
            spread = f"{fmt.ms(ms)} [{fmt.ms(r.get('ms_p20'))}–{fmt.ms(r.get('ms_p80'))}]"
            body.append([r.get("backend"), spread, fmt.times(stock / ms) if stock and ms else DASH,
                         fmt.num(r.get("peak_gib"), ".3f"), _err(r.get("loss_err")), _err(r.get("grad_h_err")),
                         _err(r.get("grad_w_err"))])
        parts.append(f"**{model}**: {first.get('tokens')} tokens × hidden {first.get('hidden')} × vocabulary "
                     f"{first.get('vocab')}, lm_head {mode}")
        parts.append(fmt.table(["kernel", "ms", "× stock", "peak GiB", "loss err", "dh err", "dW err"], body))
    return "\n\n".join(parts)


# The report's parts (harness.measured)
def bench_tables(rows: list[dict], spec: dict) -> str:
    return loss_tables(rows)
