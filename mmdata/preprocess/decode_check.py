"""Per-format full decode checks that cost a fraction of a Pillow `load()`.

Validation must prove that every image decodes, for tens of millions of records on few cores,
so the check is the biggest per-record cost of `mmdata preprocess`. Each check below runs the
part of the decoder that can fail - the entropy / deflate / bitstream parse of all the data -
and skips the arithmetic that cannot (full-size IDCT, PNG unfiltering, the WebP loop filter,
colour conversion). Every function raises OSError with a message naming what is wrong
("... truncated ..." for data that ends early); `validation.check_image` maps it to a reason.

- JPEG: libjpeg-turbo (simplejpeg) at 1/8 scale to grey, strict; anything it does not accept
  goes through Pillow's own draft decode, so a rejection is always Pillow's verdict (libjpeg
  warnings such as extraneous bytes are tolerated, as at training time). Both give a full
  decode's verdict on a corruption corpus (tests/test_decode_check_corpus.py) of the frame types
  it covers; other frame types (arithmetic coding, lossless) get Pillow's full `load()`.
- PNG (non-interlaced): every IDAT inflated with ISA-L, exact data length, valid row filters;
  a plain PNG's header chunks are read here too (as Pillow reads them), others open with Pillow.
- WebP (still): libwebp decode to YUV(A) without the in-loop filter or fancy upsampling, of a
  crop of the bottom rows (every row is still parsed; see `check_webp`).
"""

from __future__ import annotations

import re
import zlib
from importlib import metadata

import numpy as np
import simplejpeg
import webp
from isal import isal_zlib
from PIL import Image

from mmdata.media_layout import jpeg

# PNG colour type -> samples per pixel (PNG spec, table 11.1).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_PNG_PIECE = 8 << 20  # inflate in pieces of this many bytes: memory stays bounded for huge images
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# (bit depth, colour type) -> the mode Pillow opens it as (every combination the PNG spec allows;
# 16-bit colour is reduced to 8 bits, 2- and 4-bit grey widened to L). Our own table, not Pillow's
# private mode table: tests/test_decode_check.py opens a PNG of each kind with the
# installed Pillow and fails if its mode differs.
PNG_MODES = {
    (1, 0): "1",
    (2, 0): "L",
    (4, 0): "L",
    (8, 0): "L",
    (16, 0): "I;16",
    (8, 2): "RGB",
    (16, 2): "RGB",
    (1, 3): "P",
    (2, 3): "P",
    (4, 3): "P",
    (8, 3): "P",
    (8, 4): "LA",
    (16, 4): "RGBA",
    (8, 6): "RGBA",
    (16, 6): "RGBA",
}
# A chunk type is four ASCII letters (PNG spec 5.4; Pillow accepts any four word characters).
_PNG_CHUNK_TYPE = re.compile(rb"\w{4}")
# Chunks Pillow's PNG reader does something with (Pillow 10-13). A header chunk in this set and
# not in _PNG_PLAIN_CHUNKS (text, ICC profile, EXIF, APNG, a second IHDR) sends the file to
# Pillow; chunks outside it Pillow skips, CRC checked. A test compares this set with the
# installed Pillow's reader, so a Pillow that starts handling another chunk is caught.
PNG_PILLOW_CHUNKS = frozenset(
    {
        b"IHDR",
        b"PLTE",
        b"IDAT",
        b"IEND",
        b"tRNS",
        b"gAMA",
        b"cHRM",
        b"sRGB",
        b"pHYs",
        b"iCCP",
        b"tEXt",
        b"zTXt",
        b"iTXt",
        b"eXIf",
        b"acTL",
        b"fcTL",
        b"fdAT",
    }
)
# Header chunks whose Pillow handler only records a value, with the length it needs (shorter:
# Pillow refuses the file).
_PNG_PLAIN_CHUNKS = {b"PLTE": 0, b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9}
_PNG_TRNS_MIN = {"1": 2, "L": 2, "I;16": 2, "RGB": 6}  # tRNS: grey 2 bytes, truecolour 6

# The WebP check drives libwebp through the `webp` package's cffi binding (`webp.ffi`, `webp.lib`,
# `webp.WebPDecoderConfig`) and sets decoder options that binding does not name: its cdef of
# `WebPDecoderOptions` lists only `use_threads`, while libwebp's decode.h (ABI 0x02xx, 19 ints,
# use_threads at byte 40) begins `int bypass_filtering, no_fancy_upsampling, use_cropping,
# crop_left, crop_top, crop_width, crop_height;`. Those seven are written through that layout,
# which halves the check's cost (docs/preprocess.md, "Private library internals"). This rests on
# the binding as webp 0.4.x builds it, so `require_tested_webp()` runs at import and refuses
# any other version, or a layout that is not that one, by name.
TESTED_WEBP = "0.4"  # the minor version pyproject.toml pins (webp>=0.4,<0.5) and CI runs
_WEBP_OPTIONS_SIZE, _WEBP_USE_THREADS_OFFSET = 76, 40


def require_tested_webp(installed: str | None = None) -> None:
    """Raise RuntimeError, naming the installed version, unless webp is the tested minor version
    and its binding lays out `WebPDecoderOptions` as `check_webp` writes it. `installed`: the
    version to judge (default: the installed distribution's)."""
    version = installed if installed is not None else metadata.version("webp")
    if version.split(".")[:2] != TESTED_WEBP.split("."):
        raise RuntimeError(
            f"webp {version} is installed, but mmdata's WebP check is tested only with webp "
            f"{TESTED_WEBP}.x (it writes libwebp decoder options through that binding's layout): "
            f"install 'webp>={TESTED_WEBP},<0.{int(TESTED_WEBP.split('.')[1]) + 1}'"
        )
    size = webp.ffi.sizeof("WebPDecoderOptions")
    offset = webp.ffi.offsetof("WebPDecoderOptions", "use_threads")
    if (size, offset) != (_WEBP_OPTIONS_SIZE, _WEBP_USE_THREADS_OFFSET):
        raise RuntimeError(
            f"webp {version}: its WebPDecoderOptions is {size} bytes with use_threads at byte "
            f"{offset}, not the {_WEBP_OPTIONS_SIZE} and {_WEBP_USE_THREADS_OFFSET} of libwebp's "
            "decoder ABI 0x02xx that mmdata's WebP check writes into"
        )


require_tested_webp()
_ffi, _lib = webp.ffi, webp.lib
_WEBP_STATUS = {
    _lib.VP8_STATUS_OUT_OF_MEMORY: "out of memory",
    _lib.VP8_STATUS_INVALID_PARAM: "invalid parameter",
    _lib.VP8_STATUS_BITSTREAM_ERROR: "corrupt bitstream",
    _lib.VP8_STATUS_UNSUPPORTED_FEATURE: "unsupported feature",
    _lib.VP8_STATUS_SUSPENDED: "suspended",
    _lib.VP8_STATUS_USER_ABORT: "aborted",
    _lib.VP8_STATUS_NOT_ENOUGH_DATA: "image file is truncated (not enough data)",
}


_JPEG_MODES = {"Gray": "L", "YCbCr": "RGB", "RGB": "RGB", "CMYK": "CMYK", "YCCK": "CMYK"}  # Pillow's


is_jpeg = jpeg.is_jpeg


def jpeg_header(data: bytes) -> tuple[int, int, str] | None:
    """(width, height, Pillow mode) from the JPEG markers, or None when libjpeg-turbo's header
    reader does not take it (the caller then uses Pillow)."""
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError):
        return None
    mode = _JPEG_MODES.get(colorspace)
    return (w, h, mode) if mode else None


def jpeg_cheap_check_tested(data: bytes) -> bool:
    """Whether this JPEG's frame type is one the cheap checks are proven on: Huffman-coded
    baseline, extended or progressive DCT (`jpeg.TESTED_FRAMES`); arithmetic-coded and lossless
    frames get Pillow's full decode."""
    return jpeg.has_tested_frame(data)


def jpeg_decodes_cleanly(data: bytes) -> bool:
    """Entropy-decode every scan (reconstructed at 1/8 scale, luma only), with libjpeg warnings
    as errors. False is not a verdict: a warning (e.g. extraneous bytes), CMYK or real damage
    all land there, and Pillow's decoder decides (`check_jpeg_with_pillow`)."""
    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=1, min_width=1, min_factor=8, strict=True)
    except (ValueError, RuntimeError):
        return False
    return True


def check_jpeg_with_pillow(img: Image.Image) -> None:
    """Pillow's verdict at 1/8 scale (all scans are still entropy-decoded): the same verdict as a
    full `load()` on every class of tests/test_decode_check_corpus.py; only for JPEGs whose
    frame type `jpeg_cheap_check_tested` accepts."""
    w, h = img.size
    img.draft(img.mode, (max(1, w // 8), max(1, h // 8)))
    img.load()


def png_header(data: bytes) -> tuple[int, int, str] | None:
    """(width, height, Pillow mode) of a plain PNG - IHDR first, not interlaced, no chunk before
    the image data that Pillow does more with than record a value - read from its chunks with
    every header chunk's CRC and length checked as `PngImagePlugin` checks them. None for
    anything else, including damage: the caller then opens it with Pillow, whose verdict and
    message stand. (Pillow's chunk parsing in Python cost about as much as the data check.)"""
    n = len(data)
    if n < 45 or data[:8] != _PNG_SIGNATURE or data[8:16] != b"\x00\x00\x00\x0dIHDR":
        return None
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    mode = PNG_MODES.get((data[24], data[25]))
    if mode is None or data[27] or data[28] or not (w and h):  # filter method, interlace
        return None
    pos = 8
    while pos + 12 <= n:
        length, cid = int.from_bytes(data[pos : pos + 4], "big"), data[pos + 4 : pos + 8]
        if cid == b"IDAT":
            return w, h, mode
        end = pos + 8 + length
        if end + 4 > n or not _PNG_CHUNK_TYPE.fullmatch(cid):
            return None
        if cid == b"tRNS":
            if length < _PNG_TRNS_MIN.get(mode, 0):
                return None
        elif cid in _PNG_PLAIN_CHUNKS:
            if length < _PNG_PLAIN_CHUNKS[cid]:
                return None
        elif pos != 8 and cid in PNG_PILLOW_CHUNKS:
            return None
        if zlib.crc32(data[pos + 4 : end]) != int.from_bytes(data[end : end + 4], "big"):
            return None
        pos = end + 4
    return None


def check_png_stream(data: bytes, w: int, h: int) -> None:
    """Full check of a non-interlaced PNG's image data without building pixels: every IDAT
    chunk is inflated (a corrupt deflate stream fails), there must be exactly enough data for
    every row, and every row must start with a valid filter type (0-4). Header chunks (IHDR,
    PLTE, ... and their CRCs) were already checked by `Image.open`."""
    depth, ctype = data[24], data[25]
    stride = (w * _PNG_CHANNELS[ctype] * depth + 7) // 8 + 1
    need = h * stride
    parts, pos, n, seen_idat = [], 8, len(data), False
    while pos + 8 <= n:
        length = int.from_bytes(data[pos : pos + 4], "big")
        cid = data[pos + 4 : pos + 8]
        if cid == b"IDAT":
            if pos + 8 + length > n:
                raise OSError(f"image file is truncated (IDAT chunk at {pos} needs {length} bytes)")
            seen_idat = True
            parts.append(data[pos + 8 : pos + 8 + length])
        elif seen_idat or cid == b"IEND":
            break
        pos += 12 + length
    inflater = isal_zlib.decompressobj()
    pending, off = b"".join(parts), 0
    while off < need:
        try:
            out = inflater.decompress(pending, min(need - off, _PNG_PIECE))
        except isal_zlib.error as e:
            raise OSError(f"corrupt PNG image data: deflate: {e}") from None
        pending = inflater.unconsumed_tail
        if not out:
            raise OSError(f"image file is truncated ({off} of {need} bytes of image data)")
        filters = np.frombuffer(out, dtype=np.uint8)[(-off) % stride :: stride]
        if filters.size and int(filters.max()) > 4:
            raise OSError(f"unrecognized PNG row filter type {int(filters.max())}")
        off += len(out)


def is_webp(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def webp_features(data: bytes) -> tuple[int, int, bool, bool]:
    """(width, height, has_alpha, is_animated) from the WebP headers alone."""
    features = _ffi.new("WebPBitstreamFeatures *")
    status = _lib.WebPGetFeatures(_ffi.from_buffer(data), len(data), features)
    if status != _lib.VP8_STATUS_OK:
        raise OSError(f"cannot read WebP header: {_WEBP_STATUS.get(status, status)}")
    return features.width, features.height, bool(features.has_alpha), bool(features.has_animation)


def check_webp(data: bytes, width: int, height: int, has_alpha: bool) -> None:
    """Decode the (still) frame, alpha plane included, into a throw-away YUV(A) buffer.

    Only the last two or three rows are asked for (a crop that ends at the bottom edge): libwebp
    still parses every macroblock of the frame and entropy-decodes every row of the alpha plane
    (both stop at the crop's bottom, which is the image's), but it skips what cannot fail above
    the crop: copying out the rows, and expanding a paletted alpha plane to bytes (a third of an
    RGBA WebP's decode). libwebp snaps a YUV crop's top to an even row, so the top is chosen even
    and the bottom stays the last row. The in-loop filter and fancy upsampling are off too: they
    only compute pixels."""
    status = webp_decode_crop(data, width, height, has_alpha)[0]
    if status != _lib.VP8_STATUS_OK:
        raise OSError(f"WebP decode failed: {_WEBP_STATUS.get(status, status)}")


def webp_decode_crop(data: bytes, width: int, height: int, has_alpha: bool) -> tuple[int, int, int]:
    """(libwebp status, decoded width, decoded height) of `check_webp`'s decode; the size shows
    that the crop written through the options' layout took effect (tested)."""
    config = webp.WebPDecoderConfig.new()
    flags = _ffi.cast("int *", _ffi.addressof(config.ptr.options))
    flags[0] = 1  # bypass_filtering
    flags[1] = 1  # no_fancy_upsampling
    top = max(0, height - 2) & ~1
    flags[2], flags[3], flags[4], flags[5], flags[6] = 1, 0, top, width, height - top  # use_cropping, left, top, w, h
    config.output.colorspace = _lib.MODE_YUVA if has_alpha else _lib.MODE_YUV
    status = _lib.WebPDecode(_ffi.from_buffer(data), len(data), config.ptr)
    size = (config.output.width, config.output.height)
    _lib.WebPFreeDecBuffer(_ffi.addressof(config.ptr.output))
    return (status, *size)
