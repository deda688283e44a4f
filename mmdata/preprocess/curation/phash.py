"""64-bit perceptual hash, the one `imagehash.phash` computes (hash_size 8, highfreq_factor 4):
the image as greyscale, Lanczos-resized to 32x32, a 2-D DCT-II, the top-left 8x8 coefficients
compared with their median, read row-major with the first bit most significant. As an int it is
`int(str(imagehash.phash(img)), 16)` (tests/test_curation.py compares them).

The DCT is two small matrix products rather than scipy's FFT, so a coefficient that ties with
the median to within float rounding (flat colour areas) can come out differently; on images
with texture the bits are equal. Infinity-MM's `phash` field is a list holding one such integer.
"""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
from PIL import Image

HASH_SIZE = 8
IMG_SIZE = HASH_SIZE * 4
BITS = HASH_SIZE * HASH_SIZE


@lru_cache(maxsize=1)
def _dct_rows() -> np.ndarray:
    """The first HASH_SIZE rows of the unnormalised DCT-II matrix (scipy.fftpack's scaling)."""
    k = np.arange(HASH_SIZE)[:, None]
    n = np.arange(IMG_SIZE)[None, :]
    return 2.0 * np.cos(np.pi * k * (2 * n + 1) / (2 * IMG_SIZE))


def phash(image: Image.Image, fast: bool = False) -> int:
    """`fast`: resize through Pillow's reducing_gap (several times faster on big images; a few
    bits may then differ from imagehash's value). `mmdata synth` uses it to stand in for the
    producer's own hash; the job's computed hashes never do."""
    small = image.convert("L").resize(
        (IMG_SIZE, IMG_SIZE), Image.Resampling.LANCZOS, reducing_gap=3.0 if fast else None
    )
    pixels = np.asarray(small, dtype=np.float64)
    c = _dct_rows()
    low = c @ pixels @ c.T
    bits = (low > np.median(low)).ravel()
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def phash_bytes(data: bytes) -> int:
    """The hash of an encoded image (fully decoded, as imagehash would see it)."""
    with Image.open(io.BytesIO(data)) as img:
        return phash(img)


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()
