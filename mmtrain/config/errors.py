"""Recipe errors: every problem of a recipe at once, one per line, each naming its key path,
where the value came from (a command-line override or a stage patch) and, for a misspelling,
the closest valid name."""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from mmdata.errors import UserError

KeyPath = tuple[str, ...]


class RecipeError(UserError, ValueError):
    """All problems found in one recipe, one per line, each naming the key path (exit 2)."""

    def __init__(self, errors: Sequence[str], source: str = "recipe"):
        self.errors = list(errors)
        self.source = source
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid recipe {source}:\n{lines}")


class RecipeErrors:
    """Collects (path, message); attributes a path to the override or stage that set it."""

    def __init__(self, origins: dict[KeyPath, str] | None = None):
        self.items: list[str] = []
        self.origins = origins or {}

    def add(self, path: KeyPath, msg: str, involved: Sequence[KeyPath] = ()) -> None:
        """`involved`: other keys a cross-field check read, so an override that set one is named."""
        where = ".".join(path) or "<top level>"
        found = [o for o in dict.fromkeys(self._origin(q) for q in (path, *involved)) if o]
        origin = f"{_join_origins(found)}: " if found else ""
        self.items.append(f"{origin}{where}: {msg}")

    def _origin(self, path: KeyPath) -> str:
        key = tuple(p.split("[")[0] for p in path)
        for n in range(len(key), 0, -1):
            if key[:n] in self.origins:
                return self.origins[key[:n]]
        return ""

    def raise_if_any(self) -> None:
        if self.items:
            raise RecipeError(self.items)


def _join_origins(found: Sequence[str]) -> str:
    """["override 'a=1'", "override 'b=2'", "stage 'x'"] -> "overrides 'a=1', 'b=2', stage 'x'": one
    prefix per message, however many overrides set the keys a check read."""
    kinds: dict[str, list[str]] = {}
    for origin in found:
        kind, _, what = origin.partition(" ")
        kinds.setdefault(kind, []).append(what)
    return ", ".join(f"{kind}{'s' if len(whats) > 1 else ''} {', '.join(whats)}" for kind, whats in kinds.items())


def suggest(word: str, options: Sequence[str]) -> str:
    """`; did you mean 'x'?` for the closest option, or ``."""
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def show(value: Any) -> str:
    """A value as error messages quote it: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
