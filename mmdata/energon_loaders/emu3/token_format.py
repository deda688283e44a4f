"""The on-disk contract of Emu3 token shards, between `mmdata tokenize-images` (writer) and the
loaders (vq_token_sample.py beside it). Change them together, and bump `TOKEN_FORMAT_VERSION`.
It lives on the loader side so the job imports the loaders, never the other way round.

A token shard set mirrors the preprocessed shard set it was made from: the same shard names,
the same sample keys in the same order (a record the VQ could not take is absent and listed in
quarantine.jsonl). One sample = these tar members (sorted by name, as in shard_format.py):

    {key}.img00.npy, {key}.img01.npy, ...   one VQ code grid per image, in placeholder order:
                                             a 2-D (height, width) little-endian unsigned
                                             integer .npy (uint16 while the codebook fits,
                                             else uint32); read with allow_pickle=False
    {key}.json                               the text record, byte for byte the input's
                                             (shard_format.SampleRecord; its `images` still
                                             name the source members, e.g. "img00.jpg")
    {key}.vq.json                            {"grids": [{"member": "img00.npy",
                                              "source": "img00.jpg", "height": h, "width": w,
                                              "pixels": [H, W]}]} (H, W: the resized image)

A text-only record has `{key}.json` and a `vq.json` with no grids. Plus, beside the shards:
`.nv-meta/` (energon: `mmdata.yaml` names VQTokenSample, `dataset.yaml` InterleavedSample),
`manifest.json` (VQ fingerprint, image area, processor settings, counts), `quarantine.jsonl`.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass

import numpy as np

TOKEN_FORMAT_VERSION = 2  # 2: the sample type moved to mmdata.energon_loaders.emu3.vq_token_sample
VQ_JSON_MEMBER = "vq.json"
GRID_EXT = "npy"
SAMPLE_TYPE = ("mmdata.energon_loaders.emu3.vq_token_sample", "VQTokenSample")


def grid_member_name(image_member: str) -> str:
    """The grid member of an image member: "img00.jpg" -> "img00.npy"."""
    stem = image_member.split(".", 1)[0]
    return f"{stem}.{GRID_EXT}"


def grid_dtype(codebook_size: int) -> np.dtype:
    return np.dtype("<u2") if codebook_size <= 1 << 16 else np.dtype("<u4")


def encode_grid(grid: np.ndarray, codebook_size: int) -> bytes:
    """A code grid as .npy bytes (format 1.0, C order, no pickles): deterministic for equal grids."""
    if grid.ndim != 2:
        raise ValueError(f"a code grid is 2-D, got shape {grid.shape}")
    buf = io.BytesIO()
    np.lib.format.write_array(
        buf, np.ascontiguousarray(grid, dtype=grid_dtype(codebook_size)), version=(1, 0), allow_pickle=False
    )
    return buf.getvalue()


def decode_grid(data: bytes | np.ndarray) -> np.ndarray:
    """The (height, width) code grid of a grid member (raw bytes, or already decoded by a reader)."""
    if isinstance(data, np.ndarray):
        return data
    grid = np.load(io.BytesIO(data), allow_pickle=False)
    if grid.ndim != 2 or grid.dtype.kind != "u":
        raise ValueError(f"not a code grid: {grid.dtype} array of shape {grid.shape}")
    return grid


@dataclass
class GridInfo:
    member: str  # e.g. "img00.npy"
    source: str  # the image member it was made from, e.g. "img00.jpg"
    height: int  # grid rows
    width: int  # grid columns
    pixels: list[int]  # [H, W] of the resized image fed to the VQ


def encode_vq_json(grids: list[GridInfo]) -> bytes:
    return json.dumps({"grids": [asdict(g) for g in grids]}, sort_keys=True, separators=(",", ":")).encode()


def decode_vq_json(data: bytes | str | dict) -> list[GridInfo]:
    d = json.loads(data) if isinstance(data, (bytes, str)) else data
    return [GridInfo(**g) for g in d["grids"]]
