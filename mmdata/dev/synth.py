"""Write a small synthetic dataset in a real on-disk layout (Infinity-MM tar shards or
LLaVA-style JSONL + image folder), varied like the real data and optionally with a fraction
of deliberately broken records, so demos and tests exercise every path of the preprocessor.

Pictures are photo-like by default: crops of real photos resized to each record's size
(`mmdata/dev/photo_source.py`), so encoded sizes and decode costs are those of real data.
`--synthetic` (`synthetic=True`) draws colour gradients with a few rectangles instead: several
times cheaper to make and to check, for tests that need tidy fixtures, not realistic pixels.

As in the published Infinity-MM tars, a record's `image` field is by default provenance, not
a member name: mostly an absolute path on the producer's storage whose basename and extension
differ from the member `{stem}.jpg` (some records name the member exactly, some by basename
under a foreign folder; `--image-field member` writes only exact member names). `phash` is the
card's format, a list of 64-bit integers (the perceptual hash of each image).

The output is byte-deterministic for a given (--dataset, --num-samples, --seed,
--broken-fraction, --video-fraction, --samples-per-tar, --image-field, --synthetic). The image
kind changes only the pixels (a photo's crop depends only on seed and record index): the records'
structure, sizes, formats and text are the same with and without --synthetic.
"""

from __future__ import annotations

import argparse
import io
import sys
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from mmdata.cli import main as mmdata_main
from mmdata.dev.photo_source import photo_crop
from mmdata.errors import UserError
from mmdata.preprocess.curation.phash import phash
from mmdata.ray_job import remove
from mmdata.units import plural

# Broken kinds, and the quarantine reason `mmdata preprocess` must give each one.
BROKEN_KINDS: dict[str, str] = {
    "empty_image": "image_empty",
    "truncated_jpeg": "image_truncated",
    "missing_image": "image_missing",
    "malformed_json": "json_malformed",
    "placeholder_mismatch": "placeholder_mismatch",
}

# (stage, subset) folders in the Infinity-MM layout: stageN/<subset>/*.tar
SUBSETS: list[tuple[str, str]] = [
    ("stage1", "laion_caption"),
    ("stage2", "2a"),
    ("stage3", "llava_onevision"),
    ("stage4", "gpt4_synthetic"),
]

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

EN_PROMPTS = [
    "Describe this image in detail.",
    "What is shown in the picture?",
    "How many objects can you count here?",
    "What color is the largest object?",
    "Read the text in the image, if any.",
    "Is this photo taken indoors or outdoors?",
]
ZH_PROMPTS = ["请详细描述这张图片。", "图片里有什么？", "这张图片的主要颜色是什么？", "图中的文字是什么？"]
EN_ANSWERS = [
    "The image shows a gradient background with a few coloured rectangles.",
    "There are several rectangles of different colours on a smooth gradient.",
    "It looks like an abstract composition; the dominant tone is warm.",
    "No readable text is visible.",
]
ZH_ANSWERS = ["图片显示了一个渐变背景和几个彩色矩形。", "主要颜色是暖色调。", "图中没有可读的文字。"]
TEXT_ONLY = [
    (
        "Write a haiku about the sea.",
        "Waves fold into foam / the tide keeps its slow counsel / salt on the cold stones.",
    ),
    ("What is 17 * 23?", "17 * 23 = 391."),
    ("用一句话解释什么是机器学习。", "机器学习是让计算机从数据中自动学习规律的方法。"),
]


# How a record's `image` entries relate to the members (--image-field realistic): shares of
# foreign absolute paths (basename and extension unrelated to the member), the member's basename
# under a foreign folder, and the exact member name.
IMAGE_FIELD_STYLES = {"foreign": 0.7, "basename": 0.15, "exact": 0.15}
PRODUCER_ROOT = "/mnt/hpfs/baai/infinity-mm/data"
# Extensions a producer path may carry whatever the member's format is.
FOREIGN_EXTS = ["jpg", "jpeg", "JPG", "png", "webp"]


@dataclass
class SynthImage:
    name_ext: str  # "jpg" | "png" | "webp"
    data: bytes
    phash: int = 0  # perceptual hash of the picture before encoding (the producer's `phash`)


def _encode_video(rng: np.random.Generator) -> bytes:
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


@dataclass
class SynthRecord:
    index: int
    stage: str
    subset: str
    stem: str
    record: dict
    images: list[SynthImage] = field(default_factory=list)
    broken: str | None = None  # a key of BROKEN_KINDS
    json_bytes: bytes = b""
    video: bytes | None = None  # an MP4 clip (member `{stem}.mp4`), for video records
    member_names: list[str] = field(default_factory=list)  # the image members, `{stem}[.k].{ext}`
    members_sorted: bool = False  # members written in name order (`{stem}.1.png` before `{stem}.jpg`)

    @property
    def id(self) -> str:
        return str(self.record["id"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        choices=["infinity-mm", "llava-json"],
        default="infinity-mm",
        help="on-disk layout to write (default: infinity-mm)",
    )
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="output directory (new or empty; see --overwrite)"
    )
    parser.add_argument("--num-samples", type=int, required=True, metavar="N", help="number of records")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--broken-fraction",
        type=float,
        default=0.0,
        help=f"fraction of deliberately broken records, cycling through {', '.join(BROKEN_KINDS)} (default 0)",
    )
    parser.add_argument(
        "--video-fraction",
        type=float,
        default=0.0,
        help="fraction of records that are short MP4 clips with a <video> turn (default 0)",
    )
    parser.add_argument(
        "--samples-per-tar", type=int, default=100, help="records per tar file in the infinity-mm layout (default 100)"
    )
    parser.add_argument(
        "--image-field",
        choices=["realistic", "member"],
        default="realistic",
        help="infinity-mm `image` field: realistic (mostly foreign absolute paths whose "
        "basename/extension differ from the member, as in the published tars) or "
        "member (exact member names) (default realistic)",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="colour gradients with a few rectangles instead of photo-like crops of real photos: "
        "cheap tidy fixtures, but they compress to almost nothing and decode several times "
        "faster than real images (default: photo-like)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --output: first delete what synth writes there (stageN/ "
        "folders, or annotations.jsonl, images/ and videos/); other files are kept",
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m mmdata.dev.synth ...`: the subcommand alone."""
    return mmdata_main(["synth", *(sys.argv[1:] if argv is None else argv)])


def own_entries(dataset: str) -> list[str]:
    """The top-level entries synth writes into its output folder."""
    if dataset == "infinity-mm":
        return sorted({stage for stage, _ in SUBSETS})
    return ["annotations.jsonl", "images", "videos"]


def check_output(out: Path, dataset: str, overwrite: bool) -> None:
    """Refuse a file, or a non-empty folder without --overwrite (which removes synth's own
    entries first, so no stale file of a bigger earlier run stays behind)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a new or empty folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(
            f"--output {out} is not empty; choose a new or empty folder, or pass --overwrite to replace "
            f"what synth writes there ({', '.join(own_entries(dataset))})"
        )
    remove([out / name for name in own_entries(dataset) if (out / name).exists()])


def run(args: argparse.Namespace) -> int:
    if args.num_samples <= 0:
        raise UserError(f"--num-samples must be a positive number, got {args.num_samples}")
    if args.samples_per_tar <= 0:
        raise UserError(f"--samples-per-tar must be a positive number, got {args.samples_per_tar}")
    for flag, value in (("--broken-fraction", args.broken_fraction), ("--video-fraction", args.video_fraction)):
        if not 0.0 <= value <= 1.0:
            raise UserError(f"{flag} must be between 0 and 1, got {value}")
    check_output(args.output, args.dataset, args.overwrite)
    records = generate_records(
        args.num_samples,
        seed=args.seed,
        broken_fraction=args.broken_fraction,
        video_fraction=args.video_fraction,
        image_field=args.image_field,
        synthetic=args.synthetic,
    )
    if args.dataset == "infinity-mm":
        files = write_infinity_mm(records, args.output, samples_per_tar=args.samples_per_tar)
    else:
        files = write_llava_json(records, args.output)
    n_broken = sum(1 for r in records if r.broken)
    print(
        f"wrote {plural(len(records), 'record')} ({n_broken:,} broken) in {plural(len(files), 'file')} "
        f"under {args.output}"
    )
    return 0


# ----------------------------------------------------------------------------- generation


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


def _encode_image(
    rng: np.random.Generator, size: tuple[int, int], fmt: str, mode: str, photo_rng: np.random.Generator | None
) -> SynthImage:
    """A gradient drawn from `rng`, or with `photo_rng` a photo crop drawn from that alone. The
    gradient is drawn either way, so `rng`'s stream, and with it every record's structure (kinds,
    sizes, formats, text), does not depend on the image kind: only the pixels do."""
    gradient, photo = _Gradient.draw(rng, size), photo_rng is not None
    img = _with_mode(photo_crop(photo_rng, size) if photo else gradient.render(), mode, photo)
    return SynthImage(fmt, encode_image(img, fmt), phash(img, fast=True))


def _random_image(rng: np.random.Generator, photo_rng: np.random.Generator | None) -> SynthImage:
    size = IMAGE_SIZES[int(rng.choice(len(IMAGE_SIZES), p=IMAGE_SIZE_WEIGHTS / IMAGE_SIZE_WEIGHTS.sum()))]
    fmt = str(rng.choice(["jpg", "jpg", "jpg", "png", "webp"]))
    modes = {"jpg": ["RGB", "RGB", "L"], "png": ["RGB", "L", "RGBA", "P"], "webp": ["RGB", "RGBA"]}[fmt]
    mode = str(rng.choice(modes))
    return _encode_image(rng, size, fmt, mode, photo_rng)


def _member_names(rng: np.random.Generator, stem: str, images: list[SynthImage]) -> list[str]:
    """`{stem}.{ext}`, `{stem}.1.{ext}`, ...; a JPEG member is sometimes `.jpeg` or `.JPG`."""
    names = []
    for k, im in enumerate(images):
        ext = im.name_ext
        if ext == "jpg":
            ext = str(rng.choice(["jpg"] * 8 + ["jpeg", "JPG"]))
        names.append(f"{stem}.{ext}" if k == 0 else f"{stem}.{k}.{ext}")
    return names


def _image_field(rng: np.random.Generator, subset: str, members: list[str], style: str) -> list[str]:
    """The record's `image` entries for its members, in one of IMAGE_FIELD_STYLES."""
    folder = f"{PRODUCER_ROOT}/{subset}/images"
    if style == "exact":
        return list(members)
    if style == "basename":
        return [f"{folder}/{name}" for name in members]
    return [f"{folder}/{int(rng.integers(0, 2**40)):010x}_{k}.{rng.choice(FOREIGN_EXTS)}" for k in range(len(members))]


def _turns(rng: np.random.Generator, n_images: int, literal_placeholder: bool, n_rounds: int, zh: bool) -> list[dict]:
    prompts, answers = (ZH_PROMPTS, ZH_ANSWERS) if zh else (EN_PROMPTS, EN_ANSWERS)
    conv = []
    for r in range(n_rounds):
        q = str(rng.choice(prompts))
        if r == 0 and n_images and literal_placeholder:
            q = "<image>\n" * n_images + q if rng.random() < 0.8 else q + "\n" + "<image>" * n_images
        conv.append({"from": "human", "value": q})
        conv.append({"from": "gpt", "value": str(rng.choice(answers))})
    return conv


def generate_records(
    num_samples: int,
    *,
    seed: int = 0,
    broken_fraction: float = 0.0,
    video_fraction: float = 0.0,
    image_field: str = "realistic",
    synthetic: bool = False,
) -> list[SynthRecord]:
    """Generate `num_samples` varied records; broken ones are spread evenly and cycle kinds.

    Video records (opt-in) and the member/field naming come from separate random streams, so
    the records' content does not depend on them. Photo crops (the default; `synthetic`:
    gradients) come from a stream per record, seeded with (seed, index).
    """
    if image_field not in ("realistic", "member"):
        raise ValueError(f"image_field must be 'realistic' or 'member', not {image_field!r}")
    rng = np.random.default_rng(seed)
    video_rng = np.random.default_rng([seed, 1])
    names_rng = np.random.default_rng([seed, 2])
    styles, style_p = list(IMAGE_FIELD_STYLES), np.array(list(IMAGE_FIELD_STYLES.values()))
    n_broken = int(round(num_samples * broken_fraction))
    broken_at: dict[int, str] = {}
    if n_broken:
        kinds = list(BROKEN_KINDS)
        positions = np.linspace(0, num_samples - 1, n_broken).round().astype(int)
        for j, pos in enumerate(sorted(set(int(p) for p in positions))):
            broken_at[pos] = kinds[j % len(kinds)]
    out: list[SynthRecord] = []
    for i in range(num_samples):
        stage, subset = SUBSETS[i % len(SUBSETS)]
        broken = broken_at.get(i)
        kind = str(rng.choice(["caption", "caption", "single", "multiturn", "multi_image", "text_only"]))
        if broken in ("empty_image", "truncated_jpeg", "missing_image") and kind == "text_only":
            kind = "single"
        if broken == "placeholder_mismatch" and kind == "text_only":
            kind = "single"
        zh = rng.random() < 0.25
        n_images = {"caption": 1, "single": 1, "multiturn": 1, "multi_image": int(rng.integers(2, 4)), "text_only": 0}[
            kind
        ]
        photo_rng = None if synthetic else np.random.default_rng([seed, 3, i])
        images = [_random_image(rng, photo_rng) for _ in range(n_images)]
        if broken == "truncated_jpeg":
            images[0] = _encode_image(rng, (640, 480), "jpg", "RGB", photo_rng)
        literal = kind == "multi_image" or rng.random() < 0.7
        if kind == "text_only":
            q, a = TEXT_ONLY[int(rng.integers(0, len(TEXT_ONLY)))]
            conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        else:
            conv = _turns(rng, n_images, literal, int(rng.integers(2, 5)) if kind == "multiturn" else 1, zh)
        if broken == "placeholder_mismatch":
            conv[0]["value"] = "<image>\n" * (n_images + 1) + conv[0]["value"].replace("<image>", "")
        stem = f"{i:08d}"
        names = _member_names(names_rng, stem, images)
        style = str(names_rng.choice(styles, p=style_p)) if image_field == "realistic" else "exact"
        entries = _image_field(names_rng, subset, names, style)
        record = {
            "id": f"{subset}-{i:08d}",
            "source": subset,
            "conversations": conv,
            "image": (entries[0] if len(entries) == 1 else entries) if entries else None,
            "ram++_tags": [str(t) for t in rng.choice(["sky", "box", "red", "gradient", "art"], size=2, replace=False)],
            "ram++_tags_score": [round(float(s), 4) for s in rng.random(2)],
            "phash": [im.phash for im in images],
            "qw2vl_loss": round(float(rng.random() * 3), 4),
        }
        if not names:
            del record["image"], record["phash"]
        if broken == "empty_image":
            images[0] = SynthImage(images[0].name_ext, b"", images[0].phash)
        elif broken == "truncated_jpeg":
            images[0] = SynthImage("jpg", images[0].data[: len(images[0].data) // 2], images[0].phash)
        json_bytes = json.dumps(record, ensure_ascii=False).encode()
        if broken == "malformed_json":
            json_bytes = json_bytes[: len(json_bytes) // 2]
        video = None
        if video_fraction and not broken and video_rng.random() < video_fraction:
            video = _encode_video(video_rng)
            images = []
            record.pop("image", None)
            record.pop("phash", None)
            record["video"] = f"{stem}.mp4"
            record["conversations"] = [
                {"from": "human", "value": "<video>\nWhat happens in this clip?"},
                {"from": "gpt", "value": "A coloured bar moves from left to right."},
            ]
            json_bytes = json.dumps(record, ensure_ascii=False).encode()
        members_sorted = bool(names_rng.random() < 0.5) and len(names) > 1  # (one draw per record)
        if video is not None:
            names, members_sorted = [], False
        out.append(
            SynthRecord(i, stage, subset, stem, record, images, broken, json_bytes, video, names, members_sorted)
        )
    return out


# ----------------------------------------------------------------------------- writers


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_infinity_mm(records: list[SynthRecord], output: Path, *, samples_per_tar: int = 100) -> list[Path]:
    """stageN/<subset>/NNNNNN.tar, each sample `{stem}.json` followed by its image(s)."""
    by_subset: dict[tuple[str, str], list[SynthRecord]] = {}
    for rec in records:
        by_subset.setdefault((rec.stage, rec.subset), []).append(rec)
    files: list[Path] = []
    for (stage, subset), recs in sorted(by_subset.items()):
        folder = output / stage / subset
        folder.mkdir(parents=True, exist_ok=True)
        for t, start in enumerate(range(0, len(recs), samples_per_tar)):
            path = folder / f"{t:06d}.tar"
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                for rec in recs[start : start + samples_per_tar]:
                    _add_member(tar, f"{rec.stem}.json", rec.json_bytes)
                    members = [
                        (name, img.data)
                        for k, (name, img) in enumerate(zip(rec.member_names, rec.images))
                        if not (rec.broken == "missing_image" and k == 0)
                    ]
                    for name, data in sorted(members) if rec.members_sorted else members:
                        _add_member(tar, name, data)
                    if rec.video is not None:
                        _add_member(tar, rec.record["video"], rec.video)
            files.append(path)
    return files


def write_llava_json(records: list[SynthRecord], output: Path) -> list[Path]:
    """`annotations.jsonl` (one record per line, `image` relative to the output dir) + `images/`."""
    (output / "images").mkdir(parents=True, exist_ok=True)
    ann = output / "annotations.jsonl"
    with ann.open("wb") as f:
        for rec in records:
            names = [f"images/{n}" for n in rec.member_names]
            if rec.broken == "malformed_json":
                f.write(rec.json_bytes.replace(b"\n", b" ") + b"\n")
            else:
                r = dict(rec.record)
                if names:
                    r["image"] = names[0] if len(names) == 1 else names
                if rec.video is not None:
                    r["video"] = f"videos/{rec.record['video']}"
                    (output / "videos").mkdir(exist_ok=True)
                    (output / r["video"]).write_bytes(rec.video)
                f.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
            for k, (name, img) in enumerate(zip(names, rec.images)):
                if rec.broken == "missing_image" and k == 0:
                    continue
                (output / name).write_bytes(img.data)
    return [ann]


if __name__ == "__main__":
    raise SystemExit(main())
