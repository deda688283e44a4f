"""The fast per-format decode checks must give Pillow's verdict: never pass an image that a full
Pillow `load()` rejects, never reject one Pillow loads (except PNGs with a cut tail, where the
check is deliberately stricter), and report Pillow's format, size and mode."""

from __future__ import annotations

import io
import random
import re
import zlib

import numpy as np
import pytest
from PIL import Image

from mmdata.preprocess import decode_check
from mmdata.preprocess.validation import ValidationConfig, _Reject, check_image, quiet_pillow_bomb_warning

pytestmark = pytest.mark.unit


def _picture(mode: str, size: tuple[int, int] = (181, 97)) -> Image.Image:
    im = Image.effect_mandelbrot(size, (-2, -1.5, 1, 1.5), 60)
    noise = np.random.default_rng(0).integers(0, 40, size=(size[1], size[0]), dtype=np.uint8)
    im = Image.merge("RGB", (im, Image.fromarray(noise), im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)))
    if mode == "I;16":
        return im.convert("I").point(lambda v: v * 250).convert("I;16")
    if mode == "RGBA":
        im = im.convert("RGBA")
        im.putalpha(Image.fromarray(noise * 6))
        return im
    return im.convert(mode)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _pillow_loads(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
        return True
    except Exception:  # noqa: BLE001
        return False


def _agrees_with_pillow(case: bytes, fmt: str) -> bool:
    """check_image's verdict on `case` (True: it passed), asserted against a full Pillow load:
    never pass what Pillow rejects, never reject what Pillow loads (except a PNG with a cut
    tail, where the check is stricter). Rejections carry a damage reason."""
    try:
        check_image(case, "x", ValidationConfig())
        ok = True
    except _Reject as r:
        assert r.reason in ("image_truncated", "image_undecodable"), r.reason
        ok = False
    pillow_ok = _pillow_loads(case)
    assert not ok or pillow_ok, "a damaged image that Pillow rejects passed the check"
    assert ok or not pillow_ok or fmt == "PNG", "an image Pillow loads was rejected"
    return ok


def _damaged(data: bytes, seed: int, flips: int = 60) -> list[bytes]:
    rng = random.Random(seed)
    cases = [data[: int(len(data) * f)] for f in (0.05, 0.2, 0.5, 0.8, 0.95, 0.99)] + [data[:-2], data[:-20]]
    for _ in range(flips):
        b = bytearray(data)
        for _ in range(rng.choice((1, 1, 3))):
            i = rng.randrange(len(data) // 8, len(data))
            b[i] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    return cases


#: every PNG colour type and bit depth the check handles, and interlacing
PNG_CASES = [
    ("PNG", "RGB", {}),
    ("PNG", "L", {}),
    ("PNG", "P", {}),
    ("PNG", "RGBA", {}),
    ("PNG", "1", {}),
    ("PNG", "I;16", {}),
    ("PNG", "RGB", {"interlace": 1}),
]
CASES = [
    ("JPEG", "RGB", {"quality": 85}),
    ("JPEG", "RGB", {"quality": 95, "subsampling": 0}),
    ("JPEG", "RGB", {"progressive": True}),
    ("JPEG", "L", {}),
    ("JPEG", "CMYK", {}),
    *PNG_CASES,
    ("WEBP", "RGB", {"quality": 80}),
    ("WEBP", "RGBA", {"quality": 80}),
    ("WEBP", "RGBA", {"lossless": True}),
    ("WEBP", "RGB", {"lossless": True}),
]


@pytest.mark.parametrize("fmt,mode,kw", CASES)
def test_verdict_format_size_and_mode_match_pillow(fmt, mode, kw):
    data = _encode(_picture(mode), fmt, **kw)
    ext, w, h, got_mode = check_image(data, "x", ValidationConfig())
    ref = Image.open(io.BytesIO(data))
    assert (w, h, got_mode) == (*ref.size, ref.mode)
    assert ext == {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[fmt]
    rejected = sum(
        not _agrees_with_pillow(case, fmt) for case in _damaged(data, seed=hash((fmt, mode, str(kw))) & 0xFFFF)
    )
    assert rejected > 0  # the damage really exercised the failure paths


def test_webp_alpha_plane_is_checked():
    """A still WebP with a lossy colour frame and a separate alpha chunk: damage confined to the
    alpha chunk must be caught (the YUVA decode decodes the alpha plane too)."""
    data = _encode(_picture("RGBA"), "WEBP", quality=80)
    pos = data.index(b"ALPH")
    size = int.from_bytes(data[pos + 4 : pos + 8], "little")
    bad = bytearray(data)
    for i in range(pos + 9, pos + 8 + size, 7):
        bad[i] ^= 0xFF
    assert not _pillow_loads(bytes(bad))
    with pytest.raises(_Reject):
        check_image(bytes(bad), "x", ValidationConfig())


def _riff_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 12
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks.append((data[pos : pos + 4], data[pos + 8 : pos + 8 + size]))
        pos += 8 + size + (size & 1)
    return chunks


def _riff(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"WEBP" + b"".join(cid + len(p).to_bytes(4, "little") + p + b"\0" * (len(p) & 1) for cid, p in chunks)
    return b"RIFF" + len(body).to_bytes(4, "little") + body


@pytest.mark.parametrize("alpha", ["paletted", "graded"])
@pytest.mark.parametrize("height", [1, 2, 3, 16, 17, 32, 33, 97])
def test_webp_alpha_rows_are_all_decoded_whatever_the_height(height, alpha):
    """The check decodes a crop at the bottom of the frame (see `check_webp`): the alpha plane's
    last rows must still be entropy-decoded, the colour frame's last macroblocks parsed. Cutting
    the compressed alpha stream's last bytes (the last row's codes; chunk sizes fixed, so only the
    alpha stream is short) fails whenever Pillow fails. (Measured: a crop ending one row short accepts these cuts.)
    Paletted alpha
    takes libwebp's 8-bit path, graded alpha the 32-bit one."""
    rng = np.random.default_rng(height)
    plane = (
        rng.integers(0, 4, (height, 67)) * 80
        if alpha == "paletted"
        else np.linspace(0, 200, 67)[None, :] + rng.integers(0, 40, (height, 67))
    )
    im = _picture("RGBA", (67, height))
    im.putalpha(Image.fromarray(plane.astype(np.uint8)))
    data = _encode(im, "WEBP", quality=80)
    chunks = _riff_chunks(data)
    assert [cid for cid, _ in chunks] == [b"VP8X", b"ALPH", b"VP8 "]
    alph = chunks[1][1]
    assert height < 16 or alph[0] & 3 == 1  # compressed (tiny planes may be stored raw)
    assert check_image(data, "x", ValidationConfig())[1:3] == (67, height)
    rejected = 0
    for cut in (1, 2, 3, 5, 8, 13, 21, 34):
        if cut < len(alph) - 1:
            rejected += not _agrees_with_pillow(_riff([chunks[0], (b"ALPH", alph[:-cut]), chunks[2]]), "WEBP")
    assert rejected > 0  # the cuts did reach data the decoder needs
    # and the colour frame: its last macroblock row's tokens are parsed too
    vp8 = chunks[2][1]
    assert (
        sum(
            not _agrees_with_pillow(_riff([chunks[0], chunks[1], (b"VP8 ", vp8[:-cut])]), "WEBP")
            for cut in (1, 3, 8, 21)
            if cut < len(vp8) // 2
        )
        > 0
    )


def test_truncated_jpeg_is_image_truncated():
    data = _encode(_picture("RGB", (640, 480)), "JPEG", quality=90)
    with pytest.raises(_Reject) as e:
        check_image(data[: len(data) // 2], "x", ValidationConfig())
    assert e.value.reason == "image_truncated"


def test_pixel_guard_runs_before_any_decode():
    cfg = ValidationConfig(max_image_pixels=100 * 100)
    for fmt in ("JPEG", "PNG", "WEBP"):
        with pytest.raises(_Reject) as e:
            check_image(_encode(_picture("RGB", (200, 120)), fmt), "big", cfg)
        assert e.value.reason == "image_too_large"


def test_animated_webp_and_gif_go_through_pillow():
    frames = [_picture("RGB", (64, 48)).rotate(a) for a in (0, 90, 180)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=50)
    assert decode_check.webp_features(buf.getvalue())[3]  # animated
    assert check_image(buf.getvalue(), "a.webp", ValidationConfig())[:3] == ("webp", 64, 48)
    assert check_image(_encode(frames[0], "GIF"), "a.gif", ValidationConfig())[:3] == ("gif", 64, 48)


def test_fast_jpeg_path_is_taken_for_plain_jpegs():
    """Guards the speed: a plain baseline JPEG is decided without Pillow."""
    data = _encode(_picture("RGB"), "JPEG")
    assert decode_check.jpeg_header(data) == (181, 97, "RGB")
    assert decode_check.jpeg_decodes_cleanly(data)
    assert not decode_check.jpeg_decodes_cleanly(data[: len(data) // 2])


@pytest.mark.parametrize(
    "fmt,mode,kw",
    [*PNG_CASES, ("WEBP", "RGB", {"quality": 80}), ("WEBP", "RGBA", {"lossless": True}), ("JPEG", "L", {})],
)
def test_image_check_catches_whatever_a_full_pillow_decode_catches(fmt, mode, kw):
    """The fast per-format checks (PNG inflate + row filters, WebP frame decode, JPEG draft) must
    reject every truncated or corrupted image that a full Pillow `load()` rejects."""
    im = Image.effect_mandelbrot((181, 97), (-2, -1.5, 1, 1.5), 60)
    im = im.convert("I").point(lambda v: v * 250).convert("I;16") if mode == "I;16" else im.convert(mode)
    data = _encode(im, fmt, **kw)
    assert check_image(data, "x", ValidationConfig())[1:3] == (181, 97)
    rng = random.Random(0)
    cases = [data[: int(len(data) * f)] for f in (0.2, 0.5, 0.8, 0.95)] + [data[:-20]]
    for _ in range(30):
        b = bytearray(data)
        i = rng.randrange(len(data) // 4, len(data))
        b[i] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    for case in cases:
        _agrees_with_pillow(case, fmt)


def test_check_keeps_warning_filters_other_threads_add(monkeypatch):
    """The check must not save and restore the process's warning filters around a decode: the
    driver scans in a thread while its main thread imports Ray, and a filter an import adds
    meanwhile (requests silencing urllib3's SOCKS warning) was lost, printing that warning."""
    import warnings

    class OtherThreadsWarning(UserWarning):
        pass

    real = decode_check.check_png_stream

    def check_while_an_import_adds_a_filter(*args):
        warnings.filterwarnings("ignore", category=OtherThreadsWarning)
        return real(*args)

    monkeypatch.setattr(decode_check, "check_png_stream", check_while_an_import_adds_a_filter)
    try:
        assert check_image(_encode(_picture("RGB"), "PNG"), "x", ValidationConfig())[0] == "png"
        assert any(f[2] is OtherThreadsWarning for f in warnings.filters)
    finally:
        warnings.filters[:] = [f for f in warnings.filters if f[2] is not OtherThreadsWarning]


def test_over_pillows_limit_the_job_limit_decides():
    """Above Pillow's MAX_IMAGE_PIXELS (but under twice it) the job's own --max-image-pixels
    decides: a larger limit admits the image, the default one rejects it as image_too_large.
    (Pillow's warning is silenced as a scan task does it.)"""
    quiet_pillow_bomb_warning()
    w, h = 10_000, Image.MAX_IMAGE_PIXELS // 10_000 + 10  # just over Pillow's limit
    data = _encode(Image.new("L", (w, h)), "PNG", compress_level=1)
    assert check_image(data, "big", ValidationConfig(max_image_pixels=2 * w * h))[1:3] == (w, h)
    with pytest.raises(_Reject) as e:
        check_image(data, "big", ValidationConfig())
    assert e.value.reason == "image_too_large"


def _png_variants() -> list[tuple[str, bytes]]:
    """PNGs as real data has them: every mode Pillow writes, palette transparency, grey and
    truecolour tRNS, pHYs, gAMA-free and optimised files, text and ICC chunks, and APNG."""
    from PIL import PngImagePlugin

    out = []
    base = _picture("RGB", (61, 37))
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        im = base.convert(mode) if mode != "I;16" else _picture("I;16", (61, 37))
        out.append((f"{mode}", _encode(im, "PNG")))
        out.append((f"{mode} optimize", _encode(im, "PNG", optimize=True)))
        out.append((f"{mode} dpi", _encode(im, "PNG", dpi=(72, 72))))
    out.append(("P tRNS", _encode(base.convert("P"), "PNG", transparency=3)))
    out.append(("L tRNS", _encode(base.convert("L"), "PNG", transparency=7)))
    out.append(("RGB tRNS", _encode(base, "PNG", transparency=(1, 2, 3))))
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "a text chunk")
    out.append(("RGB tEXt", _encode(base, "PNG", pnginfo=info)))
    out.append(("RGB iCCP", _encode(base, "PNG", icc_profile=b"\0" * 200)))
    out.append(
        ("APNG", _encode(base, "PNG", save_all=True, append_images=[base.transpose(Image.Transpose.ROTATE_180)]))
    )
    return out


def _pillow_png_header(data: bytes):
    """What the validator takes from Pillow: (size, mode, plain) or None when it cannot open."""
    try:
        im = Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - any refusal
        return None
    plain = im.format == "PNG" and not im.info.get("interlace") and not getattr(im, "is_animated", False)
    return (im.size, im.mode, plain)


def test_png_header_is_pillows_reading_or_leaves_it_to_pillow():
    """The fast PNG header reader either gives exactly what Pillow's open gives (size and mode
    of a plain PNG) or returns None so that Pillow decides: on every variant and on thousands
    of damaged headers (bit flips and cuts in the chunks before the image data)."""
    rng = random.Random(7)
    taken = 0
    for label, data in _png_variants():
        mine, pillow = decode_check.png_header(data), _pillow_png_header(data)
        if label in ("RGB tEXt", "RGB iCCP", "APNG"):
            assert mine is None, label  # chunks Pillow does more with: Pillow opens these
        else:
            assert mine is not None and ((mine[0], mine[1]), mine[2], True) == pillow, (label, mine, pillow)
        idat = data.index(b"IDAT")
        for _ in range(150):
            bad = bytearray(data)
            if rng.random() < 0.8:
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(8, idat + 4)
                    bad[i] ^= 1 << rng.randrange(8)
            else:
                bad = bad[: rng.randrange(8, idat + 8)]
            mine = decode_check.png_header(bytes(bad))
            if mine is not None:
                taken += 1
                assert ((mine[0], mine[1]), mine[2], True) == _pillow_png_header(bytes(bad)), label
    assert taken > 0  # some damage leaves a readable header (e.g. in an unknown chunk's value)
    plain = _encode(_picture("RGB", (61, 37)), "PNG")
    assert decode_check.png_header(b"\x00" + plain[1:]) is None  # no PNG signature: not read as one


def test_png_fast_path_gives_pillows_verdict_on_the_image_data():
    """A plain PNG taken by the fast header reader gets the same stream check as before: a cut
    or corrupt image stream is still rejected, with the same reasons."""
    data = _encode(_picture("RGB", (320, 200)), "PNG")
    assert check_image(data, "x", ValidationConfig())[:3] == ("png", 320, 200)
    with pytest.raises(_Reject) as e:
        check_image(data[: len(data) * 2 // 3], "x", ValidationConfig())
    assert e.value.reason == "image_truncated"


def _png_chunk(cid: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + cid + body + zlib.crc32(cid + body).to_bytes(4, "big")


def _raw_png(depth: int, ctype: int, w: int = 5, h: int = 3) -> bytes:
    """A PNG of any (bit depth, colour type) the spec allows, built from its chunks."""
    stride = (w * decode_check._PNG_CHANNELS[ctype] * depth + 7) // 8
    rows = b"".join(b"\0" + bytes((17 * (r + i)) % 256 for i in range(stride)) for r in range(h))
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes((depth, ctype, 0, 0, 0))
    plte = _png_chunk(b"PLTE", bytes(i % 256 for i in range(3 * 256))) if ctype == 3 else b""
    return (
        decode_check._PNG_SIGNATURE
        + _png_chunk(b"IHDR", ihdr)
        + plte
        + _png_chunk(b"IDAT", zlib.compress(rows))
        + _png_chunk(b"IEND", b"")
    )


def test_png_mode_table_is_the_installed_pillows():
    """Our (bit depth, colour type) -> mode table, which replaced Pillow's private `_MODES`, is
    what the installed Pillow opens each kind of PNG as, for every combination the PNG spec
    allows: a Pillow that changes a mode fails here, not silently in the validator."""
    spec = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
    assert set(decode_check.PNG_MODES) == {(d, c) for c, depths in spec.items() for d in depths}
    for (depth, ctype), mode in decode_check.PNG_MODES.items():
        data = _raw_png(depth, ctype)
        im = Image.open(io.BytesIO(data))
        im.load()
        assert im.mode == mode, (depth, ctype, im.mode)
        assert decode_check.png_header(data) == (5, 3, mode), (depth, ctype)
    assert decode_check.png_header(_raw_png(8, 0)[:24] + bytes((3,)) + _raw_png(8, 0)[25:]) is None  # no such PNG


def test_png_chunks_pillow_handles_are_the_installed_pillows():
    """Our list of the chunks Pillow's PNG reader acts on is the installed Pillow's (its reader
    has a `chunk_<type>` method for each); a chunk outside the list is one Pillow skips, so a
    plain PNG carrying one is still read by the fast header reader."""
    from PIL import PngImagePlugin

    pillows = {name[len("chunk_") :].encode() for name in dir(PngImagePlugin.PngStream) if name.startswith("chunk_")}
    assert pillows == decode_check.PNG_PILLOW_CHUNKS
    data = _raw_png(8, 2)
    idat = data.index(b"IDAT") - 4
    for cid in (b"vpAg", b"tIME", b"prVt"):
        with_chunk = data[:idat] + _png_chunk(cid, b"12345678") + data[idat:]
        assert decode_check.png_header(with_chunk) == (5, 3, "RGB"), cid
        Image.open(io.BytesIO(with_chunk)).load()


def test_webp_gate_names_the_installed_version():
    """The WebP check writes decoder options through webp 0.4.x's binding layout: any other
    version is refused at import, by name, instead of decoding with wrong options."""
    from importlib import metadata

    installed = metadata.version("webp")
    assert installed.startswith(decode_check.TESTED_WEBP + ".")
    decode_check.require_tested_webp()  # the installed one passes
    for other in ("0.5.0", "1.0.2", "0.3.0"):
        with pytest.raises(RuntimeError, match=rf"webp {re.escape(other)} is installed.*webp>=0.4,<0.5"):
            decode_check.require_tested_webp(other)


@pytest.mark.parametrize("height,alpha", [(97, False), (96, True), (1, False), (2, True)])
def test_webp_options_written_through_the_layout_take_effect(height, alpha):
    """The crop set through the options' layout is what libwebp decodes (two or three bottom
    rows): were the offsets wrong, the decode would be the full frame or fail."""
    im = _picture("RGBA" if alpha else "RGB", (181, height))
    data = _encode(im, "WEBP", quality=80)
    w, h, has_alpha, _ = decode_check.webp_features(data)
    status, out_w, out_h = decode_check.webp_decode_crop(data, w, h, has_alpha)
    top = max(0, h - 2) & ~1
    assert (status, out_w, out_h) == (0, w, h - top)
