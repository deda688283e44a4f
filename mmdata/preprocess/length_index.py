"""Writing `lengths.parquet` (the length index, described in lengths.py) at the job's finish, on the
driver. A module of its own because the scan tasks import lengths.py to count, and they need no
pyarrow (a quarter second per worker process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata.preprocess.lengths import LENGTHS_COLUMNS, LENGTHS_DTYPE
from mmdata.shard_job.lengths import LENGTHS_NAME, VISION_TILES
from mmdata.shard_job.shard_writer import sha256_file


def _arrow_column(pa, values: np.ndarray, type_):
    """A numpy integer column as an Arrow array without `pa.array`, which imports pandas (0.25 s
    of the job's finish) to check whether it was handed a pandas object."""
    data = np.ascontiguousarray(values, dtype=type_.to_pandas_dtype())
    return pa.Array.from_buffers(type_, len(data), [None, pa.py_buffer(data)])


def write_length_index(out: Path, parts: list[tuple[int, Path]], text_tokens: str) -> str:
    """`lengths.parquet` from the shards' parts [(first global index, part file)], one row
    group per shard, streamed (memory: one shard). Returns its sha256."""
    schema = pa.schema(
        [
            ("index", pa.int64()),
            ("shard", pa.int32()),
            ("text_tokens", pa.int32()),
            ("image_tokens", pa.int32()),
            ("total_tokens", pa.int32()),
            (VISION_TILES, pa.int32()),
        ],
        metadata={"mmdata.text_tokens": text_tokens},
    )
    tmp = out / f".{LENGTHS_NAME}.tmp"
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for shard, (first, part) in enumerate(parts):
            a = np.fromfile(part, dtype=LENGTHS_DTYPE).reshape(-1, LENGTHS_COLUMNS)
            n = len(a)
            columns = [
                np.arange(first, first + n, dtype=np.int64),
                np.full(n, shard, dtype=np.int32),
                a[:, 0],
                a[:, 1],
                a[:, 0] + a[:, 1],
                a[:, 2],
            ]
            writer.write_table(
                pa.Table.from_arrays([_arrow_column(pa, c, f.type) for c, f in zip(columns, schema)], schema=schema)
            )
    tmp.replace(out / LENGTHS_NAME)
    return sha256_file(out / LENGTHS_NAME)
