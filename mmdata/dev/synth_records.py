"""The synthetic dataset's records: varied conversations (captions, multi-turn, multi-image,
text-only, optional video), the `image` field as the published tars write it, and a fraction of
deliberately broken records. `mmdata/dev/synth.py` describes the dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mmdata.dev.synth_media import SynthImage, draw_image, encode_video, random_image

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
        images = [random_image(rng, photo_rng) for _ in range(n_images)]
        if broken == "truncated_jpeg":
            images[0] = draw_image(rng, (640, 480), "jpg", "RGB", photo_rng)
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
            video = encode_video(video_rng)
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
