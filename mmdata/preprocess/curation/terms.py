"""Names a --mix or --filter term gives (sources, subsets, fields) checked against the ones
that exist: a misspelt source would otherwise mix or filter out its records with exit 0."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name a typo most likely meant: one the term is part of (`laion` for
    `laion_caption`, which difflib's ratio misses), else difflib's closest; None if none is close."""
    names = sorted(set(known))
    low = name.lower()
    part = [k for k in names if low and low in k.lower()]
    if part:
        return min(part, key=len)
    close = difflib.get_close_matches(name, names, n=1)
    return close[0] if close else None


def shown(name: str) -> str:
    """A group name for a message ('' is the top of the input root)."""
    return "(top level)" if name == "" else name


def unmatched(where: str, kind: str, bad: Iterable[str], known: Iterable[str]) -> str:
    """One line: the terms matching nothing, a "did you mean" each where one is close, and
    every name the input actually has."""
    known = sorted(set(known))
    parts = []
    for b in sorted(set(bad)):
        guess = closest(b, known)
        parts.append(f"{b!r}" + (f" (did you mean {guess!r}?)" if guess is not None else ""))
    plural = "" if len(parts) == 1 else "s"
    return (
        f"{where}: no {kind}{plural} {', '.join(parts)} in the input; its {kind}s: "
        f"{', '.join(shown(k) for k in known) or '(none)'}"
    )
