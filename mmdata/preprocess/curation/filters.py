"""`--filter EXPR`: record filters, parsed and checked before any work starts.

An expression is `FIELD OP VALUE`: `qw2vl_loss<=2.5`, `source in [a, b]`, `min_side>=32`,
`turns<=20`, `modality != text_only`. Operators: `< <= > >= == !=` and `in` / `not in` with a
`[a, b, ...]` list. A record is kept when it satisfies every rule; a record that fails is counted
under the first rule it fails (in command-line order), so the counts add up. A rule on a field
the record does not have does not apply to it (`min_side>=32` keeps text-only records; a record
without `qw2vl_loss` passes `qw2vl_loss<=2.5`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mmdata.preprocess.curation.terms import closest

NUMBER, TEXT = "number", "text"
# field -> (type, what it is); the values come from curation.features.RecordFeatures
FIELDS: dict[str, tuple[str, str]] = {
    "qw2vl_loss": (NUMBER, "the record's Qwen2-VL quality loss (Infinity-MM)"),
    "source": (TEXT, "the record's `source` field"),
    "subset": (TEXT, "the input file's folder under the input root, e.g. stage2/2a"),
    "id": (TEXT, "the record id"),
    "modality": (TEXT, "text_only, single_image, multi_image or video"),
    "images": (NUMBER, "number of images"),
    "min_side": (NUMBER, "smallest side in pixels over the record's images"),
    "max_side": (NUMBER, "largest side in pixels over the record's images"),
    "turns": (NUMBER, "conversation turns, system turns not counted"),
    "text_chars": (NUMBER, "characters of conversation text, placeholders not counted"),
}
_ORDER_OPS = ("<=", ">=", "<", ">")
_EXPR = re.compile(r"^\s*([A-Za-z_][\w+]*)\s*(<=|>=|==|!=|<|>|\bnot\s+in\b|\bin\b)\s*(.*?)\s*$")


class FilterError(ValueError):
    """A malformed --filter expression (reported before the job starts)."""


@dataclass(frozen=True)
class FilterRule:
    field: str
    op: str  # one of < <= > >= == != in notin
    value: Any  # float | str | tuple of those

    @property
    def expr(self) -> str:
        """The canonical spelling (the name counts are reported under)."""
        if self.op in ("in", "not in"):
            return f"{self.field} {self.op} [{', '.join(_show(v) for v in self.value)}]"
        return f"{self.field}{self.op}{_show(self.value)}"

    def values(self) -> tuple[Any, ...]:
        """The value(s) the rule compares with (a list's items, or the one value)."""
        return self.value if self.op in ("in", "not in") else (self.value,)

    def passes(self, features: dict[str, Any]) -> bool:
        have = features.get(self.field)
        if have is None:
            return True
        if self.op == "in":
            return have in self.value
        if self.op == "not in":
            return have not in self.value
        if self.op == "==":
            return have == self.value
        if self.op == "!=":
            return have != self.value
        return {"<": have < self.value, "<=": have <= self.value, ">": have > self.value, ">=": have >= self.value}[
            self.op
        ]


def _show(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _value(field: str, text: str, expr: str) -> float | str:
    kind = FIELDS[field][0]
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    elif kind == TEXT and not text:
        raise FilterError(f"--filter {expr!r}: missing value")
    if kind == TEXT:
        return text
    try:
        v = float(text)
    except ValueError:
        raise FilterError(f"--filter {expr!r}: {field} is a number, {text!r} is not") from None
    if math.isnan(v):
        raise FilterError(f"--filter {expr!r}: NaN is not a comparable value")
    return v


def parse_filter(expr: str) -> FilterRule:
    m = _EXPR.match(expr)
    if not m:
        raise FilterError(
            f"--filter {expr!r}: expected FIELD OP VALUE, e.g. 'qw2vl_loss<=2.5' or "
            f"'source in [a, b]' (OP: < <= > >= == != in, not in)"
        )
    field, op, rest = m[1], " ".join(m[2].split()), m[3]
    if field not in FIELDS:
        guess = closest(field, FIELDS)
        hint = f" (did you mean {guess!r}?)" if guess is not None else ""
        raise FilterError(f"--filter {expr!r}: unknown field {field!r}{hint}; fields: {', '.join(FIELDS)}")
    if op in ("in", "not in"):
        if not (rest.startswith("[") and rest.endswith("]")):
            raise FilterError(f"--filter {expr!r}: `{op}` takes a list, e.g. [a, b]")
        items = [x for x in rest[1:-1].split(",") if x.strip()]
        if not items:
            raise FilterError(f"--filter {expr!r}: empty list")
        return FilterRule(field, op, tuple(_value(field, x, expr) for x in items))
    if op in _ORDER_OPS and FIELDS[field][0] == TEXT:
        raise FilterError(f"--filter {expr!r}: {field} is text; use ==, !=, in or not in")
    return FilterRule(field, op, _value(field, rest, expr))


def parse_filters(exprs: list[str]) -> list[FilterRule]:
    rules = [parse_filter(e) for e in exprs]
    seen: set[str] = set()
    for r in rules:
        if r.expr in seen:
            raise FilterError(f"--filter {r.expr!r} given twice")
        seen.add(r.expr)
    return rules


def first_failed(rules: list[FilterRule], features: dict[str, Any]) -> FilterRule | None:
    return next((r for r in rules if not r.passes(features)), None)
