"""Photo-like pictures for `mmdata synth`: crops of public-domain photos that scikit-image ships
in its wheel (`skimage/data`), resized to the record's size.

Colour gradients compress to almost nothing and decode in a fraction of a photo's time, so
benchmarks on them flatter every step that decodes. Real photos give real entropy: a 1024 x 768
crop is 40-190 KiB as a JPEG at quality 90 (median about 120; the whole `coffee` or `chelsea`
photo at that size: 110-150 KiB), where a gradient is about 30 KiB.
The files are read directly (Pillow through importlib.resources), never through
`skimage.data`, some of whose functions download; each is decoded once per process.
"""

from __future__ import annotations

import functools
import importlib.resources
import io

import numpy as np
from PIL import Image

from mmdata.errors import UserError

# People, an animal, a still life, a launch, astronomy, a retina, microscopy, grass, printed text
# and a greyscale photo: all in scikit-image's wheel (no download), each stated public domain, CC0
# or free of known copyright restrictions in skimage.data's docstrings.
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
    "grass.png",
    "text.png",
    "camera.png",
)
MIN_CROP_SHARE = 0.5  # a crop's side is 50-100 % of the largest crop of the target's aspect


@functools.cache
def source_photo(name: str) -> Image.Image:
    """One of PHOTOS, decoded to RGB (cached: a process decodes each photo once)."""
    try:
        data = (importlib.resources.files("skimage") / "data" / name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise UserError(
            f"photo-like images read {name} from scikit-image's bundled data ({e}); install "
            "scikit-image (the `dev` extra: pip install mmdata[dev]) or pass --synthetic for gradients"
        ) from None
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def photo_crop(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """An RGB picture of `size`: a random crop of a random photo with the target's aspect ratio,
    sometimes mirrored, resized (up or down) to `size`. Depends only on `rng`'s draws."""
    w, h = size
    photo = source_photo(PHOTOS[int(rng.integers(0, len(PHOTOS)))])
    pw, ph = photo.size
    aspect = w / h
    max_w, max_h = (ph * aspect, ph) if pw / ph > aspect else (pw, pw / aspect)
    share = MIN_CROP_SHARE + (1 - MIN_CROP_SHARE) * float(rng.random())
    cw, ch = max(1.0, max_w * share), max(1.0, max_h * share)
    x0, y0 = float(rng.random()) * (pw - cw), float(rng.random()) * (ph - ch)
    img = photo.resize((w, h), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch), reducing_gap=2.0)
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else img
