"""The length index of token shards (`mmdata tokenize-images --tokenizer DIR`): what
`mmdata pack-plan` needs to plan Emu3 packing exactly (mmdata/energon_loaders/emu3/plan_lengths.py).

`DIR/lengths.parquet` has one row per written sample in output order: `index` (energon's global
sample index: its position over the shards in order), `key` (its shard key, the input's: token
shards keep them, so quarantined records leave gaps), `shard` (its shard's number), and the
per-task lengths `understanding_tokens`, `generation_tokens` (-1: the task encoder skips the
sample in that task) and `image_block_tokens` (its first image's block; 0 without images). Its
metadata `mmdata.length_index` names the kind (`emu3`), the text tokenizer (sha256 of its
folder) and the system prompt the lengths were counted with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata.packing.emu3_geometry import INDEX_META, KIND, LENGTH_COLUMNS
from mmdata.shard_job.lengths import LENGTHS_NAME
from mmdata.shard_job.shard_writer import sha256_file


def shard_part(keys: list[str], lengths: list[list[int]]) -> bytes:
    """A shard's part of the index (its samples' keys and lengths, in order), as the write stage saves it."""
    return json.dumps({"keys": keys, "lengths": lengths}).encode()


def write_token_length_index(out: Path, parts: list[Path], tokenizer_sha256: str, system_prompt: str) -> str:
    """`lengths.parquet` from the written shards' parts, in shard order; returns its sha256."""
    meta = {"kind": KIND, "tokenizer_sha256": tokenizer_sha256, "system_prompt": system_prompt}
    schema = pa.schema(
        [("index", pa.int64()), ("key", pa.string()), ("shard", pa.int32())]
        + [(c, pa.int32()) for c in LENGTH_COLUMNS],
        metadata={INDEX_META: json.dumps(meta)},
    )
    tmp = out / f".{LENGTHS_NAME}.tmp"
    first = 0
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for shard, part in enumerate(parts):
            doc = json.loads(part.read_text())
            n = len(doc["keys"])
            lengths = np.asarray(doc["lengths"], dtype=np.int32).reshape(n, len(LENGTH_COLUMNS))
            columns = [
                pa.array(np.arange(first, first + n, dtype=np.int64)),
                pa.array(doc["keys"], pa.string()),
                pa.array(np.full(n, shard, dtype=np.int32)),
            ] + [pa.array(lengths[:, i]) for i in range(len(LENGTH_COLUMNS))]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
            first += n
    tmp.replace(out / LENGTHS_NAME)
    return sha256_file(out / LENGTHS_NAME)
