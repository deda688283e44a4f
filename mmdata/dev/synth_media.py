"""The synthetic dataset's media: pictures (a photo crop, or a cheap gradient with rectangles) in
the formats and colour modes of real data, and tiny MPEG-4 clips. `mmdata/dev/synth.py` says
how the records use them."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmdata.dev.photo_source import photo_crop
from mmdata.preprocess.curation.phash import phash

# (width, height) choices: tiny, common, very wide, very tall, > 2000 px.
IMAGE_SIZES: list[tuple[int, int]] = [
    (32, 32),
    (48, 64),
    (224, 224),
    (336, 252),
    (640, 480),
    (480, 640),
    (512, 384),
    (1024, 768),
    (1200, 160),
    (2048, 96),
    (96, 2048),
    (160, 1400),
    (2100, 1400),
]
IMAGE_SIZE_WEIGHTS = np.array([6, 5, 10, 10, 10, 8, 8, 4, 3, 2, 2, 3, 1], dtype=float)


@dataclass
class SynthImage:
    name_ext: str  # "jpg" | "png" | "webp"
    data: bytes
    phash: int = 0  # perceptual hash of the picture before encoding (the producer's `phash`)


def encode_video(rng: np.random.Generator) -> bytes:
    """A tiny MPEG-4 clip (PyAV): a few frames of a moving bar."""
    import av  # (a heavy dependency, needed only with --video-fraction)

    w, h, n = int(rng.choice([64, 96])), 48, int(rng.integers(4, 12))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        color = rng.integers(0, 256, size=3)
        for i in range(n):
            frame = np.zeros((h, w, 3), np.uint8)
            frame[:, (i * w // n) : (i * w // n) + 8] = color
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@dataclass(frozen=True)
class _Gradient:
    """A cheap but non-trivial RGB picture: a colour gradient plus a few solid rectangles."""

    size: tuple[int, int]
    colours: np.ndarray  # (2, 3): left and right
    rects: list[tuple[int, int, int, int, np.ndarray]]  # (x0, y0, x1, y1, colour)

    @classmethod
    def draw(cls, rng: np.random.Generator, size: tuple[int, int]) -> _Gradient:
        w, h = size
        colours = rng.integers(0, 256, size=(2, 3))
        rects = []
        for _ in range(int(rng.integers(1, 4))):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            x1 = min(w, x0 + int(rng.integers(1, max(2, w // 2))))
            y1 = min(h, y0 + int(rng.integers(1, max(2, h // 2))))
            rects.append((x0, y0, x1, y1, rng.integers(0, 256, size=3)))
        return cls(size, colours, rects)

    def render(self) -> Image.Image:
        (w, h), (c0, c1) = self.size, self.colours
        t = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]
        row = (c0[None, None, :] * (1 - t) + c1[None, None, :] * t).astype(np.uint8)
        arr = np.repeat(row, h, axis=0)
        for x0, y0, x1, y1, colour in self.rects:
            arr[y0:y1, x0:x1] = colour
        return Image.fromarray(arr, "RGB")


def _with_mode(img: Image.Image, mode: str, photo: bool) -> Image.Image:
    """The RGB picture as `mode`: L, RGB, RGBA (the top half semi-transparent) or P (32 colours;
    a photo through the fast octree quantizer: median cut takes seconds on a photo)."""
    w, h = img.size
    if mode == "L":
        img = img.convert("L")
    elif mode == "RGBA":
        img = img.convert("RGBA")
        alpha = np.full((h, w), 255, dtype=np.uint8)
        alpha[: h // 2] = 128
        img.putalpha(Image.fromarray(alpha, "L"))
    elif mode == "P" and photo:
        img = img.quantize(32, method=Image.Quantize.FASTOCTREE)
    elif mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    return img


def encode_image(img: Image.Image, fmt: str, quality: int = 85) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, format="JPEG", quality=quality)
    elif fmt == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        img.save(buf, format="WEBP", quality=quality - 5, method=0)
    return buf.getvalue()


def draw_image(
    rng: np.random.Generator, size: tuple[int, int], fmt: str, mode: str, photo_rng: np.random.Generator | None
) -> SynthImage:
    """A gradient drawn from `rng`, or with `photo_rng` a photo crop drawn from that alone. The
    gradient is drawn either way, so `rng`'s stream, and with it every record's structure (kinds,
    sizes, formats, text), does not depend on the image kind: only the pixels do."""
    gradient, photo = _Gradient.draw(rng, size), photo_rng is not None
    img = _with_mode(photo_crop(photo_rng, size) if photo else gradient.render(), mode, photo)
    return SynthImage(fmt, encode_image(img, fmt), phash(img, fast=True))


def random_image(rng: np.random.Generator, photo_rng: np.random.Generator | None) -> SynthImage:
    size = IMAGE_SIZES[int(rng.choice(len(IMAGE_SIZES), p=IMAGE_SIZE_WEIGHTS / IMAGE_SIZE_WEIGHTS.sum()))]
    fmt = str(rng.choice(["jpg", "jpg", "jpg", "png", "webp"]))
    modes = {"jpg": ["RGB", "RGB", "L"], "png": ["RGB", "L", "RGBA", "P"], "webp": ["RGB", "RGBA"]}[fmt]
    mode = str(rng.choice(modes))
    return draw_image(rng, size, fmt, mode, photo_rng)
