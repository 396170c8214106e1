"""Fine-tuning optimizations for Hugging Face models, each behind its own switch.

    import optim
    model = optim.enable(model)                    # every optimization on where it helps
    model = optim.enable(model, offload="single")  # or pick per switch (also OPTIM_<NAME> env vars)

``optim`` imports only torch, transformers and peft; it never imports the benchmark harness.
Each optimization is one module exposing ``SWITCHES`` (its switch declarations) and
``enable(model, **settings)``.
"""

from __future__ import annotations

from optim.switches import Switch

__all__ = ["Switch"]
