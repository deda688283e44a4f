"""The loader decodes JPEGs with libjpeg-turbo directly (simplejpeg, into RGBX: Pillow's own
layout of RGB) only where its pixels are Pillow's bit for bit, so anyres parity with
transformers (tests/test_anyres.py, which feeds Pillow images) carries over unchanged: every
class here is either decoded to exactly Pillow's RGB pixels, or handed back to Pillow (None)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.task_encoder import _decode_image
from mmdata.media_layout import jpeg
from tests.llava_tiny import hf_image_processor

pytestmark = pytest.mark.unit

SIZES = [(1, 1), (2, 3), (7, 5), (16, 16), (17, 9), (33, 31), (181, 97), (331, 257)]
PILLOW_KINDS = {
    "4:4:4": {"subsampling": 0},
    "4:2:2": {"subsampling": 1},
    "4:2:0": {"subsampling": 2},
    "progressive 4:2:0": {"progressive": True},
    "progressive 4:4:4": {"progressive": True, "subsampling": 0},
    "restart intervals": {"restart_marker_blocks": 3},
    "optimised q95": {"quality": 95, "optimize": True},
}


def _picture(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    w, h = size
    rng = np.random.default_rng(w * 7 + h)
    a = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    base = np.asarray(Image.effect_mandelbrot(size, (-2, -1.5, 1, 1.5), 60))
    a[..., 0], a[..., 2] = base, base // 2 + a[..., 2] // 4
    return Image.fromarray(a).convert(mode)


def _jpeg(size: tuple[int, int], mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    _picture(size, mode).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _pillow_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(anyres.to_rgb(im))


def _assert_exact(data: bytes, label) -> None:
    im = jpeg.decode_rgb_exact(data)
    assert im is not None, label  # this class takes the direct decode
    assert im.mode == "RGB"
    assert np.array_equal(np.asarray(im), _pillow_rgb(data)), label


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("kind", PILLOW_KINDS)
def test_direct_decode_is_pillows_pixels_bit_for_bit(kind, mode):
    for size in SIZES:
        _assert_exact(_jpeg(size, mode, **PILLOW_KINDS[kind]), (kind, mode, size))


@pytest.mark.parametrize("subsampling", ["444", "422", "420", "440", "411"])
def test_libjpeg_turbo_encoded_files_too(subsampling):
    for size in ((17, 9), (181, 97), (640, 480)):
        data = simplejpeg.encode_jpeg(np.asarray(_picture(size)), 88, colorsubsampling=subsampling)
        _assert_exact(data, (subsampling, size))


def test_classes_that_differ_or_are_untested_go_to_pillow():
    """CMYK (Pillow's conversion differs), arithmetic-coded frames (no corpus), damaged or
    warned-about files (Pillow's verdict stands), and non-JPEGs: None, and the loader's decode
    is then exactly Pillow's."""
    base = _jpeg((67, 45))
    sof = base.index(b"\xff\xc0")
    png = io.BytesIO()
    _picture((9, 9)).save(png, format="PNG")
    others = {
        "cmyk": _jpeg((67, 45), "CMYK"),
        "arithmetic": base[: sof + 1] + b"\xc9" + base[sof + 2 :],
        "truncated": base[: len(base) // 2],
        "extraneous bytes": base[: base.index(b"\xff\xda")] + b"\x12\x34" + base[base.index(b"\xff\xda") :],
        "png": png.getvalue(),
    }
    for label, data in others.items():
        assert jpeg.decode_rgb_exact(data) is None, label
    for label in ("cmyk", "extraneous bytes", "png"):
        with _decode_image(others[label]) as im:
            assert np.array_equal(np.asarray(anyres.to_rgb(im)), _pillow_rgb(others[label])), label
    with pytest.raises(OSError, match="truncated"):
        _decode_image(others["truncated"])


@pytest.mark.parametrize("size", [(181, 97), (1023, 767)])
def test_anyres_tiles_are_identical_and_match_transformers(size):
    """The loader's anyres tiles from the direct decode equal those from Pillow's decode
    exactly, and stay within test_anyres's tolerance of transformers' processor."""
    data = _jpeg(size, quality=90)
    with _decode_image(data) as im:
        assert isinstance(im, Image.Image) and jpeg.decode_rgb_exact(data) is not None
        ours = anyres.process_image(im)
    with Image.open(io.BytesIO(data)) as pil:
        pil.load()
        pillows = anyres.process_image(pil)
        ref = hf_image_processor().preprocess(pil, return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours.pixel_values, pillows.pixel_values)
    assert ours.pixel_values.shape == ref.shape
    assert (ours.pixel_values - ref).abs().max().item() <= 1e-5
