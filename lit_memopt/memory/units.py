"""Byte counts as people read them: one formatter for every report, error and table of the pack."""

from __future__ import annotations

__all__ = ["format_bytes", "GIB", "MIB", "KIB"]

KIB, MIB, GIB = 2**10, 2**20, 2**30


def format_bytes(n: float, small: str = "bytes") -> str:
    """``12.34 GiB`` / ``5.00 MiB`` / ``2.00 KiB`` (binary units, two decimals); below 1 KiB ``N bytes``.

    ``small`` names the unit of the last case (``"B"`` in compact tables).
    """
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} {small}"
