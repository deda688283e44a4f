"""The `.nv-meta/sample_loader.py` of every shard set mmdata writes (copied there as is).

It must import nothing from mmdata: with it, energon's standard `InterleavedSample` (named by
`.nv-meta/dataset.yaml`) reads our shards where mmdata is not installed (`energon info/lint/
preview`, `get_train_dataset(DIR)` with any task encoder). Our own loaders read the richer
`mmdata.yaml` instead (mmdata/energon_configs.py).

`sequence` is the record's conversation as text, one line per turn, `"{from}: {value}"` (turns
joined with "\\n"), cut at every `<image>` / `<video>` placeholder, with the medium itself in
its place:
  - preprocess shards: each `<image>` is the image member it names (record `images`, in order),
    as energon's decoder hands it over: a CHW float tensor with the default `SampleDecoder`,
    the encoded bytes with decoding off; `<video>` is the video member (energon's `AVDecoder`
    with the default decoder, else bytes);
  - VQ token shards (`mmdata tokenize-images`): each `<image>` is the (height, width) grid of
    VQ codes of that image, an int64 tensor (the grids listed in the `vq.json` member, in order).
Media without a placeholder are appended at the end; a placeholder without a medium stays text.
So `"".join(x if isinstance(x, str) else "<image>" ...)` gives the turns back.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import torch

RECORD = "json"
GRIDS = "vq.json"
IMAGE = "<image>"
VIDEO = "<video>"
_PLACEHOLDER = re.compile(f"({re.escape(IMAGE)}|{re.escape(VIDEO)})")


def _json(part):
    return json.loads(part) if isinstance(part, (bytes, str)) else part


def _grid(part) -> torch.Tensor:
    grid = part if isinstance(part, np.ndarray) else np.load(io.BytesIO(part), allow_pickle=False)
    return torch.from_numpy(np.ascontiguousarray(grid, dtype=np.int64))


def _text(conversations) -> str:
    return "\n".join(f"{turn.get('from', '?')}: {turn.get('value', '')}" for turn in conversations or [])


def interleave(text: str, images: list, videos: list) -> list:
    """`text` cut at its placeholders, each replaced by the next medium of its kind."""
    queues = {IMAGE: list(images), VIDEO: list(videos)}
    sequence: list = []
    for piece in _PLACEHOLDER.split(text):
        if piece in queues and queues[piece]:
            sequence.append(queues[piece].pop(0))
        elif piece:
            if sequence and isinstance(sequence[-1], str):
                sequence[-1] += piece
            else:
                sequence.append(piece)
    return sequence + queues[IMAGE] + queues[VIDEO]


def sample_loader(raw: dict) -> dict:
    """The `InterleavedSample` fields of one sample's raw parts."""
    record = _json(raw[RECORD])
    if GRIDS in raw:
        images = [_grid(raw[g["member"]]) for g in _json(raw[GRIDS])["grids"]]
        videos = []
    else:
        images = [raw[name] for name in record.get("images") or []]
        videos = [raw[record["video"]]] if record.get("video") else []
    return {"sequence": interleave(_text(record.get("conversations")), images, videos)}


def part_filter(part: str) -> bool:
    """The record, the grid index of token shards, images (or their grids) and the video."""
    return part in (RECORD, GRIDS) or part.startswith("img") or part.startswith("video.")
