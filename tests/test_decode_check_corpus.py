"""The cheap JPEG check (libjpeg-turbo at 1/8 scale, strict; Pillow's 1/8 draft decode for what
it does not accept) must give exactly the verdict of a full Pillow decode (`Image.open(...).load()`,
LOAD_TRUNCATED_IMAGES off, as the product runs it) on every file of a corruption corpus built
here: truncation at many offsets; bit flips in the headers, the quantisation and Huffman tables,
the frame and scan headers, the restart interval and the scan data; missing and duplicated
markers (SOI, SOF, DQT, DHT, DRI, SOS, RST, EOI, APP0); bytes where libjpeg only warns. Classes:
4:2:0, 4:2:2, 4:4:4, 4:4:0, 4:1:1 (Pillow and libjpeg-turbo's encoders), grey, CMYK, progressive,
optimised Huffman tables, restart intervals, odd sizes.

Arithmetic coding: no installed encoder writes it (Pillow cannot; simplejpeg has no option), so
there is no corpus of real arithmetic-coded files. The product sends every frame type outside
`mmdata.media_layout.jpeg.TESTED_FRAMES` to the full decode instead; files relabelled SOF9/SOF10 (their
Huffman data then read by libjpeg's arithmetic decoder) check that routing."""

from __future__ import annotations

import io
import random
from collections import Counter

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from mmdata.media_layout import jpeg
from mmdata.preprocess import decode_check
from mmdata.preprocess.validation import ValidationConfig, _Reject, check_image

pytestmark = pytest.mark.unit

_SIZE = (83, 61)  # odd: partial MCUs on both edges


def _picture(mode: str, size: tuple[int, int] = _SIZE) -> Image.Image:
    im = Image.effect_mandelbrot(size, (-2, -1.5, 1, 1.5), 60)
    noise = np.random.default_rng(0).integers(0, 60, size=(size[1], size[0]), dtype=np.uint8)
    im = Image.merge("RGB", (im, Image.fromarray(noise), im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)))
    return im.convert(mode)


def _pillow_jpeg(mode: str, size: tuple[int, int] = _SIZE, **kw) -> bytes:
    buf = io.BytesIO()
    _picture(mode, size).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _turbo_jpeg(subsampling: str) -> bytes:
    return simplejpeg.encode_jpeg(np.asarray(_picture("RGB", (257, 131))), 88, colorsubsampling=subsampling)


def _bases() -> dict[str, bytes]:
    bases = {
        "420": _pillow_jpeg("RGB", quality=85),
        "444": _pillow_jpeg("RGB", quality=95, subsampling=0),
        "422": _pillow_jpeg("RGB", quality=90, subsampling=1),
        "grey": _pillow_jpeg("L"),
        "cmyk": _pillow_jpeg("CMYK"),
        "progressive": _pillow_jpeg("RGB", progressive=True),
        "progressive 444": _pillow_jpeg("RGB", progressive=True, subsampling=0),
        "progressive grey": _pillow_jpeg("L", progressive=True),
        "progressive cmyk": _pillow_jpeg("CMYK", progressive=True),
        "optimised huffman": _pillow_jpeg("RGB", optimize=True),
        "restart every 2 blocks": _pillow_jpeg("RGB", restart_marker_blocks=2),
        "restart every row": _pillow_jpeg("RGB", restart_marker_rows=1),
        "progressive restart": _pillow_jpeg("RGB", progressive=True, restart_marker_blocks=3),
        "larger, restart every 4": _pillow_jpeg("RGB", (240, 176), quality=90, restart_marker_blocks=4),
    }
    for sub in ("444", "422", "420", "440", "411"):
        bases[f"turbo {sub}"] = _turbo_jpeg(sub)
    return bases


def _segments(data: bytes) -> list[tuple[int | str, int, int]]:
    """(marker, start, end) of every marker segment (from its 0xFF to the end of its payload),
    every RST marker, and ("scan", start, end) for the entropy-coded runs between them."""
    out: list[tuple[int | str, int, int]] = [(0xD8, 0, 2)]
    pos, n = 2, len(data)
    while pos < n - 1:
        if data[pos] != 0xFF or data[pos + 1] == 0:
            end = pos
            while end < n - 1 and not (data[end] == 0xFF and data[end + 1] not in (0, 0xFF)):
                end += 1
            end = n if end >= n - 1 else end
            out.append(("scan", pos, end))
            pos = end
            continue
        marker = data[pos + 1]
        if marker in (0xD8, 0xD9, 0x01) or 0xD0 <= marker <= 0xD7:
            out.append((marker, pos, pos + 2))
            pos += 2
            continue
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        out.append((marker, pos, end))
        pos = end
    return out


_FLIP_REGIONS = {  # region -> markers whose payload it is ("scan": the entropy-coded data)
    "dqt": {0xDB},
    "dht": {0xC4},
    "frame header": {0xC0, 0xC1, 0xC2},
    "scan header": {0xDA},
    "restart interval": {0xDD},
    "other headers": {0xE0, 0xE1, 0xE2, 0xEE, 0xFE},
    "scan": {"scan"},
}
_MARKERS = {"SOI": {0xD8}, "SOF": {0xC0, 0xC1, 0xC2}, "DQT": {0xDB}, "DHT": {0xC4}, "DRI": {0xDD}}
_MARKERS |= {"SOS": {0xDA}, "RST": set(range(0xD0, 0xD8)), "EOI": {0xD9}, "APP0": {0xE0}}


def _corrupted(data: bytes, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    segs, n = _segments(data), len(data)
    cuts = set(range(1, min(n, 700), 23)) | {n * k // 40 for k in range(1, 40)} | {n - k for k in range(1, 9)}
    cases = [("truncated", data[:cut]) for cut in sorted(cuts) if 0 < cut < n]
    for region, markers in _FLIP_REGIONS.items():
        where = [i for m, s, e in segs if m in markers for i in range(s if m == "scan" else s + 4, e)]
        for _ in range(30 if region == "scan" else 20) if where else ():
            bad = bytearray(data)
            for _ in range(rng.choice((1, 1, 2))):
                bad[rng.choice(where)] ^= 1 << rng.randrange(8)
            cases.append((f"bit flip: {region}", bytes(bad)))
    for name, markers in _MARKERS.items():
        for s, e in [(s, e) for m, s, e in segs if m in markers][:4]:
            cases.append((f"missing {name}", data[:s] + data[e:]))
            cases.append((f"duplicated {name}", data[:e] + data[s:e] + data[e:]))
    sos = next(s for m, s, _ in segs if m == 0xDA)
    cases.append(("bytes after EOI", data + b"\x00trailing"))
    cases.append(("fill bytes before SOS", data[:sos] + b"\xff\xff" + data[sos:]))
    cases.append(("extraneous bytes before SOS", data[:sos] + b"\x12\x34" + data[sos:]))
    return cases


def _arithmetic_relabelled(data: bytes) -> bytes:
    """The file with its SOF0/SOF2 marker changed to SOF9/SOF10 (arithmetic coding)."""
    s = next(s for m, s, _ in _segments(data) if m in (0xC0, 0xC2))
    return data[: s + 1] + bytes(({0xC0: 0xC9, 0xC2: 0xCA}[data[s + 1]],)) + data[s + 2 :]


def _product_accepts(data: bytes) -> bool:
    try:
        check_image(data, "x", ValidationConfig())
    except _Reject as r:
        assert r.reason in ("image_truncated", "image_undecodable"), r.reason
        return False
    return True


def _full_decode_accepts(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any refusal is a rejection
        return False
    return True


def test_cheap_jpeg_verdicts_equal_the_full_decode_on_the_corruption_corpus():
    verdicts: Counter = Counter()
    paths: Counter = Counter()
    differ = []
    for base_name, base in _bases().items():
        assert decode_check.jpeg_cheap_check_tested(base), base_name
        assert decode_check.jpeg_decodes_cleanly(base), base_name  # the fast path takes every class
        for label, case in [("intact", base), *_corrupted(base, seed=len(base))]:
            mine, full = _product_accepts(case), _full_decode_accepts(case)
            if mine != full:
                differ.append((base_name, label, mine, full))
            verdicts[label.split(":")[0], full] += 1
            paths["libjpeg-turbo" if decode_check.jpeg_decodes_cleanly(case) else "pillow draft"] += 1
    assert not differ, differ[:20]
    # the corpus reaches both verdicts where damage can go either way, and both deciders
    for label in ("bit flip", "duplicated SOS", "missing DHT", "missing SOS"):
        assert verdicts[label, True] and verdicts[label, False], (label, verdicts)
    assert verdicts["truncated", False] > 500 and not verdicts["truncated", True]
    assert paths["libjpeg-turbo"] > 300 and paths["pillow draft"] > 1000, paths


def test_arithmetic_coded_frames_get_the_full_decode():
    """Frame types without a corpus (arithmetic, lossless) never take the cheap check: the
    verdict is the full decode's, including on damage."""
    for base in (_pillow_jpeg("RGB"), _pillow_jpeg("RGB", progressive=True), _pillow_jpeg("L")):
        relabelled = _arithmetic_relabelled(base)
        assert jpeg.frame_type(relabelled) in (0xC9, 0xCA)
        assert not decode_check.jpeg_cheap_check_tested(relabelled)
        for _, case in [("intact", relabelled), *_corrupted(relabelled, seed=1)[::7]]:
            assert _product_accepts(case) == _full_decode_accepts(case)


def test_frame_type_walks_markers_not_bytes():
    """An EXIF thumbnail (its own SOF) or a marker-like byte pair inside an APP segment is not
    the frame header."""
    base = _pillow_jpeg("RGB", progressive=True)
    app = b"\xff\xe1" + (2 + 6).to_bytes(2, "big") + b"\xff\xc9\xff\xc0xx"
    with_app = base[:2] + app + base[2:]
    assert jpeg.frame_type(with_app) == 0xC2
    assert jpeg.frame_type(b"\xff\xd8\xff\xda\x00\x02") is None
    assert jpeg.frame_type(base[:2]) is None
