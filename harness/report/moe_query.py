"""The MoE bench's dynamic-query model (``moe_query_model`` rows): the loop's E routing queries
against sorted's one, each length's saving predicted from the per-query cost c of the other lengths."""

from __future__ import annotations

import statistics

from harness.report import fmt
from harness.report.offload import ratio_cell
from harness.variant_keys import SWITCHES

MOE_BACKENDS = tuple(b for b in SWITCHES["moe_backend"].choices if b != "auto")


def predicted_from_other_lengths(query: list[dict]) -> list[tuple[dict, float | None]]:
    """Each ``moe_query_model`` row with its saving predicted from the others: (E − 1)·c, c the
    median per-query cost of the other lengths of its model on its GPU type (None where it has none)."""
    out = []
    for r in query:
        others = [fmt.number(o.get("per_query_ms")) for o in query if o is not r and o.get("model") == r.get("model")
                  and o.get("gpu_slug") == r.get("gpu_slug") and o.get("tokens") != r.get("tokens")]
        others = [c for c in others if c is not None]
        q = r.get("queries_per_layer") if isinstance(r.get("queries_per_layer"), dict) else {}
        extra = (fmt.number(q.get("loop")) or 0) - (fmt.number(q.get("sorted")) or 0)
        out.append((r, extra * statistics.median(others) if others and extra else None))
    return out


def query_model_md(rows: list[dict]) -> str:
    """The table ("" without ``moe_query_model`` rows)."""
    query = [r for r in rows if r.get("kind") == "moe_query_model"]
    if not query:
        return ""
    body = []
    for r, pred in sorted(predicted_from_other_lengths(query),
                          key=lambda x: (fmt.natural(x[0].get("model")), fmt.number(x[0].get("tokens")) or 0)):
        q = r.get("queries_per_layer") if isinstance(r.get("queries_per_layer"), dict) else {}
        meas = fmt.number(r.get("measured_saving_ms"))
        body.append([r.get("model"), r.get("tokens"), fmt.joined(" / ", *(fmt.num(q.get(b), "d") for b in MOE_BACKENDS)),
                     fmt.num(r.get("per_query_ms"), ".3f"), fmt.ms(pred), fmt.ms(meas),
                     ratio_cell(meas / pred if meas is not None and pred else None)])
    return ("#### Dynamic-query model\n\n" + fmt.table(
        ["model", "tokens", "queries / layer loop / sorted / grouped_mm", "c ms / query at this length",
         "predicted saving ms / layer (E−1)·c, c from the other lengths", "measured loop − sorted ms",
         "measured / predicted"], body)
        + "\n\nc = (loop − sorted) / (E − 1) on the routing path. Each length's prediction takes c from the "
          "other lengths of the same model and GPU (their median), never from the measurement it predicts; "
          "a length measured alone has no prediction. Under gradient checkpointing a training step pays the "
          "forward twice.")
