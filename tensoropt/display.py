"""How every command prints an estimate: the search tables, compile's summary, inspect's
estimate line and the search's messages about memory budgets show the same text for the
same figure."""

from __future__ import annotations


def fmt_step_time(seconds: float) -> str:
    """A step time as every command prints an estimate: the search tables, compile's
    summary and inspect's estimate line show the same text for the same plan."""
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def fmt_memory(nbytes: float) -> str:
    """Memory per device as every command prints an estimate (see :func:`fmt_step_time`):
    GiB from a quarter of one, KiB below one MiB, bytes below one KiB (a budget of 1B
    read "0.00 KiB")."""
    if nbytes >= 2**28:
        return f"{nbytes / 2**30:.3f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.2f} MiB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.2f} KiB"
    return f"{nbytes:.0f} B"
