"""JPEG facts both the preprocess decode check and the training loader rely on: the frame type
(from the marker segments), and a libjpeg-turbo decode (simplejpeg, about twice Pillow's speed)
used only for the classes of file where its pixels are Pillow's bit for bit.

simplejpeg with `fastdct=False, fastupsample=False` runs libjpeg-turbo's accurate integer IDCT
and fancy upsampling, as Pillow does, so YCbCr and grey JPEGs of the tested frame types give
Pillow's RGB pixels exactly (tests/test_loader_jpeg.py: sizes down to 1x1, odd sizes, 4:4:4,
4:2:2, 4:2:0, 4:4:0, 4:1:1, progressive, restart intervals). CMYK/YCCK (Pillow inverts Adobe
CMYK and converts differently), arithmetic-coded and lossless frames, files with any libjpeg
warning (`strict`: damage, extraneous bytes) and images over Pillow's pixel limit return None:
the caller decodes those with Pillow, so its verdict and pixels stand."""

from __future__ import annotations

import simplejpeg
from PIL import Image

# Huffman-coded baseline, extended and progressive DCT: the frame types that
# tests/test_decode_check_corpus.py and tests/test_loader_jpeg.py cover. Arithmetic coding and
# lossless JPEG (no installed encoder writes them, so no corpus) are left to Pillow.
TESTED_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RST0-7, SOI: no length field
_PIXEL_EXACT_COLORSPACES = frozenset({"YCbCr", "Gray"})


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def frame_type(data: bytes) -> int | None:
    """The SOF marker (0xC0-0xCF, not DHT/JPG/DAC) of a JPEG, found by walking the marker
    segments before it (so an EXIF thumbnail's frame is not taken); None if there is none."""
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xDA:  # a scan before any frame header
            return None
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return None


def has_tested_frame(data: bytes) -> bool:
    """A JPEG whose frame type is in TESTED_FRAMES."""
    return is_jpeg(data) and frame_type(data) in TESTED_FRAMES


def decode_rgb_exact(data: bytes) -> Image.Image | None:
    """The image as an RGB Pillow image whose pixels are Pillow's own decode of `data` converted
    to RGB, or None when this file is not of a class where libjpeg-turbo's direct decode is proven
    equal (see the module docstring): the caller then decodes with Pillow."""
    if not has_tested_frame(data):
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in _PIXEL_EXACT_COLORSPACES or w * h > (Image.MAX_IMAGE_PIXELS or 1 << 62):
            return None
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGBX", fastdct=False, fastupsample=False, strict=True)
    except (ValueError, RuntimeError):
        return None
    # RGBX is Pillow's own layout of an RGB image: a straight copy (from packed RGB, Pillow's
    # unpacking costs a third of the decode)
    return Image.frombytes("RGB", (w, h), pixels, "raw", "RGBX")
