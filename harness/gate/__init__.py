"""Regression gates, for CI.

Two modes:
  * ``files``: a candidate's result rows against a committed baseline's (``python -m harness gate
    --baseline FILE --candidate FILE``); see ``harness.gate.files``.
  * ``revisions``: two git revisions measured on this machine in one job, their rounds
    interleaved, judged with ``harness.gate.stats`` and guarded by each switch's own on/off pair
    (``python -m harness gate --base REV --head REV``); see ``harness.gate.revisions``.
"""

from harness.gate.files import (  # noqa: F401 - the file mode's API, as `harness.gate.*`
    NOISE_MODES,
    STATUSES,
    GateError,
    GateResult,
    PointResult,
    Side,
    compare,
    device_name,
    identity,
    judge,
    load_step_rows,
    parse_fraction,
    result_files,
    run,
)
