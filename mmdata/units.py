"""How numbers read in human output, the same in every command (preprocess summary, inspect,
preview, dry_run, auto_tune, training logs): binary byte units with their right names (KiB,
MiB, GiB: 3.89e9 bytes is "3.62 GiB"), counts with the noun in the right number, durations as
h:mm:ss. JSON outputs keep raw numbers."""

from __future__ import annotations

import math

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB", 3.89e9 -> "3.62 GiB" (three significant digits from KiB up)."""
    size = float(n)
    for unit in _BYTE_UNITS:
        if abs(size) < 1024 or unit == _BYTE_UNITS[-1]:
            if unit == "B":
                return f"{size:.0f} B"
            return f"{size:.3g} {unit}" if abs(size) < 1000 else f"{size:.0f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """1 -> "1 shard", 2 -> "2 shards" (thousands separated)."""
    return f"{n:,} {noun if n == 1 else plural_form or noun + 's'}"


def format_duration(seconds: float) -> str:
    """42 -> "42s", 125 -> "2:05", 3725 -> "1:02:05"; non-finite -> "?"."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
