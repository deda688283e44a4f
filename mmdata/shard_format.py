"""The on-disk contract between `mmdata preprocess` (writer), the energon loaders and
`mmdata inspect` (readers). Change it only together with all three.

One sample = contiguous tar members sharing a key (no dots in keys; webdataset splits the
key at the first dot of the basename), members sorted by name:

    {key}.img00.jpg, {key}.img01.png, ...   original encoded image bytes (never re-encoded)
    {key}.json                               the normalised record (SampleRecord below)
    {key}.video.mp4 (or .video.<ext>)        original encoded video bytes, optional

Keys are `f"{global_index:010d}"` over the shuffled output, so they are globally unique and
stable for a given (inputs, seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
JSON_MEMBER = "json"
SHARD_NAME_TEMPLATE = "shard-{:06d}.tar"
MANIFEST_NAME = "manifest.json"
QUARANTINE_NAME = "quarantine.jsonl"
ENERGON_META = ".nv-meta"  # energon's metadata folder (written last but one, before the manifest)
# A job's intermediate state; its presence without a manifest means the job has not finished.
WORK_DIR_NAME = ".mmdata-work"
# Fixed tar metadata so shards are byte-identical across runs.
TAR_MTIME = 0
TAR_UID = 0
TAR_GID = 0
TAR_UNAME = ""
TAR_GNAME = ""
TAR_MODE = 0o644


MODALITIES = ("text_only", "single_image", "multi_image", "video")


def modality_of(n_images: int, has_video: bool) -> str:
    if has_video:
        return "video"
    return "text_only" if n_images == 0 else "single_image" if n_images == 1 else "multi_image"


def image_member_name(index: int, ext: str) -> str:
    """Member suffix of the index-th image of a sample, e.g. `img00.jpg`."""
    return f"img{index:02d}.{ext.lower().lstrip('.')}"


def video_member_name(ext: str) -> str:
    return f"video.{ext.lower().lstrip('.')}"


@dataclass
class Turn:
    role: str  # "human" | "gpt" | "system" (Infinity-MM/LLaVA `from` values, kept as written)
    value: str


@dataclass
class SampleRecord:
    """Content of the `{key}.json` member.

    `conversations` is normalised: every image is referenced by exactly one `<image>` in a
    human turn (one is inserted at the start of the first human turn when the source had an
    image and no placeholder, as LLaVA does). `images` lists the member suffixes in the order
    of the placeholders.
    """

    id: str  # the original record id
    source: str  # the record's `source` field (sub-dataset name), or "" when absent
    conversations: list[dict[str, str]]  # [{"from": ..., "value": ...}]
    images: list[str] = field(default_factory=list)  # e.g. ["img00.jpg"]
    video: str | None = None  # e.g. "video.mp4"
    meta: dict[str, Any] = field(default_factory=dict)  # ram++_tags, phash, qw2vl_loss, image sizes ...
    # Where the record came from: dataset, file, member/line, index; `source_image` /
    # `source_video`: the record's `image` / `video` field exactly as the source wrote it (in
    # Infinity-MM an absolute path on the producer's storage, not a member name), when it had
    # one; `media_resolution`: how its media were found ("by_name", "by_basename", "by_stem",
    # see preprocess/adapters/media_resolution.py), when it has media.
    provenance: dict[str, Any] = field(default_factory=dict)
