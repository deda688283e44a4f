"""Offline curation without Ray: the perceptual hash against imagehash's."""

from __future__ import annotations

import io

import imagehash
import numpy as np
from PIL import Image

from mmdata.preprocess.curation.phash import _dct_rows, phash, phash_bytes
from mmdata.preprocess.synth import generate_records


def _imagehash_int(img: Image.Image) -> int:
    return int(str(imagehash.phash(img)), 16)


def _textured(i: int) -> Image.Image:
    img = Image.effect_mandelbrot((160 + i * 13, 120 + i * 7), (-2 + i * 0.02, -1.2, 0.8, 1.4), 30 + i).convert("RGB")
    noise = Image.effect_noise(img.size, 20 + i)
    return Image.merge("RGB", (noise, img.getchannel(1), img.getchannel(2))) if i % 2 else img


def test_phash_equals_imagehash():
    """Bit-equal on textured images (also after JPEG/WebP round trips, from bytes); on the
    synthetic gradients, any differing bit is a coefficient that ties with the median within
    float rounding, where imagehash's own bit is rounding noise."""
    for i in range(12):
        img = _textured(i)
        assert phash(img) == _imagehash_int(img), i
        for fmt in ("JPEG", "WEBP", "PNG"):
            buf = io.BytesIO()
            img.save(buf, format=fmt)
            assert phash_bytes(buf.getvalue()) == _imagehash_int(Image.open(io.BytesIO(buf.getvalue()))), (i, fmt)
    c = _dct_rows()
    checked = 0
    for rec in generate_records(60, seed=5):
        for im in rec.images:
            img = Image.open(io.BytesIO(im.data))
            diff = phash(img) ^ _imagehash_int(img)
            checked += 1
            if diff:
                px = np.asarray(img.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)
                low = (c @ px @ c.T).ravel()
                near = np.abs(low - np.median(low)) <= 1e-9 * np.abs(low).max()
                bits = [63 - b for b in range(64) if diff >> b & 1]  # bit 63 is coefficient 0
                assert all(near[b] for b in bits), (rec.id, bits)
    assert checked > 50
