"""Which warnings of ``torch.cuda.set_sync_debug_mode("warn")`` are host syncs."""

from __future__ import annotations

# torch's text for each synchronizing call (c10's warn_or_error_on_sync)
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(warning) -> bool:
    """A caught warning (``warnings.WarningMessage``) that reports a synchronizing call. Not torch's
    notice on entering the mode, once a process ("Synchronization debug mode is a prototype feature
    and does not yet detect all synchronizing operations"), which a match on "synchroniz" counts as
    one more sync."""
    return SYNC_WARNING in str(warning.message)
