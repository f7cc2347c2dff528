"""Byte sizes as people read them: the one formatter every message, table and log line uses. A leaf
module: it imports nothing of zerotrain."""

from __future__ import annotations

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
SCALES = {"TiB": TiB, "GiB": GiB, "MiB": MiB, "KiB": KiB}


def gib(n: float | None, units: tuple[str, ...] = ("GiB",), switch: float = 1.0, digits: int = 1) -> str:
    """`n` bytes as text, "n/a" for None: in the first of `units` (largest first) that |n| reaches `switch`
    of (0.1: 0.1 GiB reads "0.1 GiB", not "102.4 MiB"), else in the last. `digits` decimals in GiB and
    TiB; MiB and KiB always show one.

        gib(3 * 2**30) -> '3.0 GiB'; gib(2**39, units=("TiB", "GiB")) -> '512.0 GiB'
    """
    if n is None:
        return "n/a"
    unit = next((u for u in units if abs(n) >= switch * SCALES[u]), units[-1])
    return f"{n / SCALES[unit]:.{digits if SCALES[unit] >= GiB else 1}f} {unit}"


def readable(n: float) -> str:
    """A size in the largest unit it reaches, from KiB to TiB."""
    return gib(n, units=("TiB", "GiB", "MiB", "KiB"))
