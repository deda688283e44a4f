"""The energon sample type of our shards and the `sample_loader` that builds it from raw tar
parts. `.nv-meta/mmdata.yaml` names `ConversationSample` and `.nv-meta/mmdata_sample_loader.py`
re-exports `sample_loader`/`part_filter` from here: what our loaders read (`dataset.yaml`, energon's
InterleavedSample, is for readers without mmdata: shard_job/energon_sample_loader.py).

Media stay encoded (bytes) in the sample: decoding happens in the task encoder, where a bad
image can be skipped with a counted reason instead of killing a worker.
"""

from __future__ import annotations

import json
from typing import Any

from megatron.energon import Sample, edataclass

from mmdata.shard_format import JSON_MEMBER


@edataclass
class ConversationSample(Sample):
    """One instruction-tuning record: conversation turns plus encoded media."""

    #: the original record id (the tar key is `__key__`)
    id: str
    #: [{"from": "human"|"gpt"|"system", "value": str}], `<image>` placeholders normalised
    conversations: list
    #: encoded image bytes, in placeholder order
    images: list
    #: image member suffixes (e.g. "img00.jpg"), parallel to `images`
    image_names: list
    #: encoded video bytes or None
    video: Any
    #: sub-dataset / `source` field
    source: str
    #: free-form metadata (tags, phash, quality score, sizes)
    meta: dict
    #: where the record came from (input file, member/line, index)
    provenance: dict


def sample_loader(raw: dict) -> dict:
    """Map the raw parts of one tar sample to `ConversationSample` fields."""
    record_bytes = raw[JSON_MEMBER]
    record = json.loads(record_bytes) if isinstance(record_bytes, (bytes, str)) else record_bytes
    image_names = list(record.get("images") or [])
    video_name = record.get("video")
    return dict(
        id=str(record["id"]),
        conversations=record["conversations"],
        images=[raw[name] for name in image_names],
        image_names=image_names,
        video=raw.get(video_name) if video_name else None,
        source=record.get("source", ""),
        meta=record.get("meta", {}),
        provenance=record.get("provenance", {}),
    )


def part_filter(part: str) -> bool:
    """All parts of our samples are needed (json, imgNN.*, video.*)."""
    return part == JSON_MEMBER or part.startswith("img") or part.startswith("video.")
