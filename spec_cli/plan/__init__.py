"""`spec plan`: what a draft run needs before it starts (memory, FLOPs, disk, GPU hours)."""

from __future__ import annotations

from spec_cli.draft.algorithm import FINAL_HIDDEN, LM_HEAD, Algorithm


def plannable(algorithm: Algorithm) -> str | None:
    """Why `algorithm`'s step cannot be planned, or None (no torch: --help reads it)."""
    unknown = set(algorithm.needs) - {FINAL_HIDDEN, LM_HEAD}
    if unknown:
        return f"it reads target fields the planner cannot shape ({', '.join(sorted(unknown))})"
    if algorithm.name == "peagle":
        return (
            "P-EAGLE's step samples its elements from the data (COD), so its memory depends on the "
            "batch's content, which a plan does not have"
        )
    return None
