"""What a plan is made from: the planned samples' lengths, vision tiles and global indices, read
from a shard folder's length index (mmdata/preprocess/lengths.py). Image shards (`mmdata
preprocess`) give the index's totals, or their image tokens recounted from the records' header
sizes with another geometry (the text tokens kept); Emu3 token shards: emu3.py."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata import shard_format as sf
from mmdata.errors import UserError
from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.packing.geometry import DEFAULT_GEOMETRY, PlanGeometry
from mmdata.shard_job.lengths import LENGTHS_NAME, VISION_TILES
from mmdata.units import plural


@dataclass
class PlanInputs:
    """What a plan is made from: the planned samples' lengths, vision tiles and global indices, extra plan
    columns, metadata, the geometry it records, and a summary for the command's output line."""

    lengths: np.ndarray
    tiles: np.ndarray  # the vision tiles each planned sample's media cost the tower (vision-aware balancing)
    index: np.ndarray
    geometry: PlanGeometry | Emu3PlanGeometry
    summary: str
    meta: dict
    columns: dict | None = None


#: the length index's metadata key of how text tokens were counted (b"estimate" without --tokenizer)
TEXT_TOKENS_META = b"mmdata.text_tokens"


def read_lengths(root: Path) -> pa.Table:
    """The length index of a shards folder."""
    path = root / LENGTHS_NAME
    if not path.is_file():
        manifest = root / sf.MANIFEST_NAME
        tool = json.loads(manifest.read_text()).get("tool") if manifest.is_file() else None
        how = (
            "rerun `mmdata tokenize-images` with --tokenizer DIR (the Emu3 text tokenizer training uses)"
            if tool == "mmdata tokenize-images"
            else "run `mmdata preprocess` (it writes the length index)"
        )
        raise FileNotFoundError(f"{path} not found: {how}")
    return pq.read_table(path)


def require_vision_tiles(path: Path, names: list[str]) -> None:
    """Refuse a length index of image shards without its vision tiles column (one from before the column)."""
    if VISION_TILES not in names:
        raise UserError(f"{path} has no {VISION_TILES} column: rerun `mmdata preprocess` (it writes the length index)")


def recount_media(
    root: Path, table: pa.Table, geometry: PlanGeometry, on_shard: Callable[[int], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per length-index row: (its text tokens plus its media tokens, its vision tiles), the media
    recounted with `geometry` from the records in the shards (`{key}.json`, only those members are
    read). `on_shard(total)` is called once per shard read (progress)."""
    index = table.column("index").to_numpy()
    media = np.full((int(index.max()) + 1 if len(index) else 0, 2), -1, dtype=np.int64)
    shards = sorted(root.glob("shard-*.tar"))
    for tar_path in shards:
        with tarfile.open(tar_path, "r:") as tar:
            for member in tar:
                key, _, suffix = member.name.partition(".")
                if suffix == sf.JSON_MEMBER and member.isfile() and key.isdigit() and int(key) < len(media):
                    record = json.loads(tar.extractfile(member).read())
                    media[int(key)] = geometry.media_tokens(record), geometry.media_tiles(record)
        if on_shard is not None:
            on_shard(len(shards))
    missing = index[media[index, 0] < 0]
    if len(missing):
        raise FileNotFoundError(
            f"{root}: the shards lack the records of {plural(len(missing), 'sample')} of the length index "
            f"(e.g. key {int(missing[0]):010d}): rerun `mmdata preprocess`"
        )
    return table.column("text_tokens").to_numpy().astype(np.int64) + media[index, 0], media[index, 1]


def image_plan_inputs(
    root: Path,
    table: pa.Table,
    geometry: PlanGeometry | Emu3PlanGeometry | None,
    on_shard: Callable[[int], None] | None = None,
) -> PlanInputs:
    """Image shards (`mmdata preprocess`): the length index's totals, or the image tokens
    recounted with another geometry."""
    if not isinstance(geometry, PlanGeometry | None):
        raise UserError(f"{root} holds image shards (`mmdata preprocess`); the recipe's family plans token shards")
    geometry = geometry or DEFAULT_GEOMETRY
    require_vision_tiles(root / LENGTHS_NAME, table.column_names)
    if geometry == DEFAULT_GEOMETRY:  # what the length index counted
        lengths = table.column("total_tokens").to_numpy().astype(np.int64)
        tiles = table.column(VISION_TILES).to_numpy().astype(np.int64)
    else:
        try:
            lengths, tiles = recount_media(root, table, geometry, on_shard=on_shard)
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
    text = (table.schema.metadata or {}).get(TEXT_TOKENS_META, b"").decode()
    return PlanInputs(
        lengths,
        tiles,
        table.column("index").to_numpy(),
        geometry,
        f"image geometry {geometry.flags()}",
        {"text_tokens": text},
    )
