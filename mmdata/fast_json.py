"""JSON for the per-record hot path of the preprocessing job: orjson where it gives exactly what
the standard library gives, the standard library everywhere else.

Parsing and re-serialising every record was about 9% of a scan task's CPU with `json`; orjson
does both several times faster. Its verdicts differ from `json`'s in a few places, and those go
to `json`, so every record gets the value and the quarantine reason it always got:
- what orjson refuses (NaN/Infinity literals, numbers that overflow a double, lone surrogates,
  invalid UTF-8, a BOM, UTF-16/32 input) is parsed, or refused, by `json` with its own message,
  and a record parsed by `json` is written by `json` too;
- orjson reads integers outside [-2**63, 2**64) as floats, silently: bytes holding a run of
  digits beyond that range are parsed by `json` (a cheap, conservative test: Infinity-MM's
  64-bit `phash` values stay with orjson);
- orjson cannot write strings with surrogate escapes (e.g. undecodable file names) or integers
  beyond 64 bits: those records are written by `json`, whose output then fails the UTF-8 check
  that follows, as before.
The written text differs from `json.dumps` only in form (no space after `:` and `,`; floats in
their shortest form, e.g. `1e-7`): the same value, always the same bytes for the same record.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# An integer literal orjson reads as a float has more digits than, or as many as and more than,
# these (same-length digit strings compare like numbers). Digits are found with bytes.translate
# (C speed; a regular expression for long digit runs cost twice json.loads itself).
_U64_MAX, _I64_MIN_ABS = b"18446744073709551615", b"9223372036854775808"
_DIGIT_MARKS = bytes(1 if 0x30 <= b <= 0x39 else 0 for b in range(256))
_LONG_RUN = b"\x01" * len(_I64_MIN_ABS)  # shorter runs always fit


def _fits_orjson(data: bytes) -> bool:
    """No digit run in `data` that orjson would read differently from `json` if it were an
    integer literal (a run inside a string or a fraction only sends the record to `json`)."""
    marks = data.translate(_DIGIT_MARKS)
    start = marks.find(_LONG_RUN)
    while start >= 0:
        end = marks.find(b"\0", start)
        end = len(marks) if end < 0 else end
        limit = _I64_MIN_ABS if start and data[start - 1] == 0x2D else _U64_MAX  # after a "-"
        if end - start > len(limit) or (end - start == len(limit) and data[start:end] > limit):
            return False
        start = marks.find(_LONG_RUN, end)
    return True


def loads(data: bytes) -> tuple[Any, bool]:
    """(`json.loads(data)`, whether orjson read it); `json.loads`'s exception when it refuses.
    Only a value orjson read is known to hold nothing orjson would write differently (json reads
    `NaN` and `1e400` as floats that orjson would write as null)."""
    if _fits_orjson(data):
        try:
            return orjson.loads(data), True
        except orjson.JSONDecodeError:
            pass
    return json.loads(data), False


def dumps_sorted(obj: Any, by_orjson: bool = True) -> str:
    """`json.dumps(obj, ensure_ascii=False, sort_keys=True)` up to form (see above); `by_orjson`:
    whether `obj`'s parsed parts came from `loads` through orjson (False: `json` writes it)."""
    if by_orjson:
        try:
            return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()
        except TypeError:  # orjson.JSONEncodeError: see the module docstring
            pass
    return json.dumps(obj, ensure_ascii=False, sort_keys=True)
