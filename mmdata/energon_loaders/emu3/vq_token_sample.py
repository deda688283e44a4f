"""The energon sample type of token shards (`mmdata tokenize-images` output) and its
`sample_loader`. `.nv-meta/mmdata.yaml` of a token shard set names `VQTokenSample`, and its
`.nv-meta/mmdata_sample_loader.py` re-exports `sample_loader`/`part_filter` from here, so our
loaders (and `energon info --dataset-config mmdata.yaml`) read token shards as VQTokenSample. The on-disk contract is
mmdata/energon_loaders/emu3/token_format.py.

Grids arrive as (height, width) unsigned integer arrays of VQ codes; turning them into the
model's token stream (Emu3: emu3/serialize.py) is the task encoder's job.
"""

from __future__ import annotations

import json
from typing import Any

from megatron.energon import Sample, edataclass

from mmdata.shard_format import JSON_MEMBER
from mmdata.energon_loaders.emu3.token_format import GRID_EXT, VQ_JSON_MEMBER, decode_grid, decode_vq_json


@edataclass
class VQTokenSample(Sample):
    """One record: conversation turns plus the VQ code grid of each of its images."""

    #: the original record id (the tar key is `__key__`)
    id: str
    #: [{"from": "human"|"gpt"|"system", "value": str}], one `<image>` per grid, in order
    conversations: list
    #: (height, width) unsigned integer arrays of VQ codes, in placeholder order
    image_tokens: list
    #: source image member names (e.g. "img00.jpg"), parallel to `image_tokens`
    image_names: list
    #: [H, W] of the resized image each grid was encoded from
    image_pixels: list
    #: sub-dataset / `source` field
    source: str
    #: free-form metadata (tags, phash, quality score, sizes)
    meta: dict
    #: where the record came from (input file, member/line, index)
    provenance: dict


def _json(part: Any) -> Any:
    return json.loads(part) if isinstance(part, (bytes, str)) else part


def sample_loader(raw: dict) -> dict:
    """Map the raw parts of one token-shard sample to `VQTokenSample` fields."""
    record = _json(raw[JSON_MEMBER])
    grids = decode_vq_json(raw[VQ_JSON_MEMBER])
    return dict(
        id=str(record["id"]),
        conversations=record["conversations"],
        image_tokens=[decode_grid(raw[g.member]) for g in grids],
        image_names=[g.source for g in grids],
        image_pixels=[list(g.pixels) for g in grids],
        source=record.get("source", ""),
        meta=record.get("meta", {}),
        provenance=record.get("provenance", {}),
    )


def part_filter(part: str) -> bool:
    """The parts of a token sample: the record, the grid index and the grids."""
    return part in (JSON_MEMBER, VQ_JSON_MEMBER) or (part.startswith("img") and part.endswith(f".{GRID_EXT}"))
