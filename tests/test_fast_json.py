"""mmdata.fast_json gives exactly the standard library's values and verdicts (orjson only where
they agree), and writes text that reads back to the same value."""

from __future__ import annotations

import json
import math
import random

import pytest

from mmdata import fast_json

pytestmark = pytest.mark.unit

# Inputs where orjson alone would differ from json: a value, a refusal or an exception type.
AWKWARD = [
    b'{"a": 1, "a": 2}',
    b"[18446744073709551615, -9223372036854775808]",  # the ends of orjson's integer range
    b"[18446744073709551616]",
    b"[-9223372036854775809]",  # beyond it orjson gives a float
    b"[99999999999999999999]",
    b"[-12345678901234567890]",
    b"[123456789012345678901]",
    b"[9223372036854775808, 1234567890123456789, -1234567890123456789]",
    b'{"a": 1, "n": 18446744073709551616}',  # the long run at the very end
    b'{"id": 123456789012345678901234567890}',
    b'{"phash": [17123902235351557293, 1575508401181745662]}',  # Infinity-MM's 64-bit hashes
    b'{"t": "digits 12345678901234567890123 in text"}',
    b"[1e400, -1e400, 1.5e-99999999999999999999]",
    b'{"qw2vl_loss": NaN, "s": Infinity, "n": -Infinity}',
    b'"\\ud800"',
    b'"\\udcff tail"',
    b'"\\ud83d\\ude42"',
    b"\xef\xbb\xbf" + b'{"a": 1}',  # a BOM
    '{"a": "é 中"}'.encode("utf-16"),
    '{"a": "é"}'.encode("utf-32"),
    b'{"a": "\xff"}',  # invalid UTF-8
    b"",
    b"   ",
    b"{",
    b'{"a": 1} x',
    b"[1,]",
    b"nul",
    b"{'a': 1}",
    b'{"\\u0000": "\\u0000\\u001f\\u2028"}',
    b"-0",
    b"-0.0",
    b"1E5",
    b"0.1",
    b"[1e-7, 5e-324, 1.7976931348623157e308, 2.2250738585072014e-308]",
]


def _verdict(fn, data):
    try:
        return "ok", fn(data)
    except Exception as e:  # noqa: BLE001 - the exception's type and text are the verdict
        return type(e).__name__, str(e)


def _same(a, b) -> bool:
    """Equal JSON values, also in type (1 vs 1.0), sign of zero and NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("data", AWKWARD)
def test_loads_gives_json_loads_value_or_its_exception(data: bytes) -> None:
    expected = _verdict(json.loads, data)
    got = _verdict(lambda d: fast_json.loads(d)[0], data)
    assert got[0] == expected[0], (data, got, expected)
    if expected[0] == "ok":
        assert _same(got[1], expected[1]), (data, got, expected)
    else:  # the very message json gives (it reaches the quarantine detail)
        assert got[1] == expected[1]


@pytest.mark.parametrize("data", AWKWARD)
def test_dumps_sorted_reads_back_to_the_value_json_writes(data: bytes) -> None:
    try:
        value, by_orjson = fast_json.loads(data)
    except ValueError:
        return
    text = fast_json.dumps_sorted({"v": value, "b": 1}, by_orjson)
    reference = json.dumps({"v": value, "b": 1}, ensure_ascii=False, sort_keys=True)
    assert _same(json.loads(text), json.loads(reference))
    assert text.index('"b"') < text.index('"v"')  # sorted keys
    assert fast_json.dumps_sorted({"v": value, "b": 1}, by_orjson) == text  # same bytes every time


def test_non_finite_numbers_are_written_as_json_writes_them_not_as_null() -> None:
    value, by_orjson = fast_json.loads(b'{"qw2vl_loss": NaN, "big": 1e400}')
    assert not by_orjson
    assert fast_json.dumps_sorted(value, by_orjson) == '{"big": Infinity, "qw2vl_loss": NaN}'


def test_unwritable_strings_fall_back_to_json() -> None:
    """An undecodable file name (surrogate escape) in provenance: json writes it, and the UTF-8
    check that follows in the validator refuses the record, as it always did."""
    text = fast_json.dumps_sorted({"file": "bad-\udcff.tar"})
    assert text == json.dumps({"file": "bad-\udcff.tar"}, ensure_ascii=False)
    with pytest.raises(UnicodeEncodeError):
        text.encode()


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 7, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-(10**6), 10**6)])
    if kind == 2:
        return rng.choice([0.5, -0.0, 1e-7, 1e16, 3.141592653589793, rng.uniform(-1e6, 1e6), 5e-324])
    if kind in (3, 4):
        alphabet = 'ab é中🙂\n\t"\\/\x00\x1f\u2028<image>'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return {
            rng.choice(["id", "é", "b", "a", "中", "z", ""]) + str(i): _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))
        }
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_random_documents_round_trip_like_json() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        doc = _random_value(rng)
        data = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        value, by_orjson = fast_json.loads(data)
        assert _same(value, json.loads(data)), data
        assert by_orjson
        text = fast_json.dumps_sorted(value, by_orjson)
        assert _same(json.loads(text), json.loads(json.dumps(value, ensure_ascii=False, sort_keys=True))), data
