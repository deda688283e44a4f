"""The outputs `mmdata preprocess` writes beside its shards, built by one Ray task once every shard
is written: quarantine.jsonl, duplicates.jsonl, lengths.parquet and energon's index (merged in
SQLite's C code from the rows each shard writer saved). Every step here is per record, so none of
it runs in the driver (issue 47: the driver's serial share caps a cluster's speed-up); the driver
only publishes the finished `.nv-meta` folder, then the manifest."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmdata import shard_format as sf
from mmdata.preprocess.length_index import write_length_index
from mmdata.ray_job import remove, shard_outputs
from mmdata.preprocess.stages import bucket_file, scan_file
from mmdata.shard_job.energon_meta import INDEX_PART, build_index
from mmdata.shard_job.lengths import LENGTHS_NAME
from mmdata.shard_job.quarantine import concat_parts
from mmdata.shard_job.shard_writer import shard_work_file

DUPLICATES_NAME = "duplicates.jsonl"
PLAN_GLOB = "pack-plan-*.parquet"  # `mmdata pack-plan` outputs: stale once the shards change
PARTIAL_SHARD_GLOB = ".shard-*.tar.tmp-*"  # a shard writer's temp file (shard_writer.write_shard)


def our_outputs(out: Path) -> list[Path]:
    """What `--overwrite` removes: the shards, their metadata and the files beside them."""
    extra = [out / n for n in (DUPLICATES_NAME, LENGTHS_NAME) if (out / n).exists()]
    return shard_outputs(out) + extra + sorted(out.glob(PLAN_GLOB))


def write_outputs(
    out: str,
    work: str,
    units: int,
    shards: list[tuple[str, int]],
    num_buckets: int,
    dedup: bool,
    text_tokens: str | None,
) -> dict:
    """(a Ray task) quarantine.jsonl (`units` scan parts), duplicates.jsonl, the length index
    (`text_tokens` None: none), then energon's index of `shards` [(name, samples)] in a temporary
    folder. Returns {"lengths_sha256", "energon_meta": that folder, for `publish_index`}."""
    o, w = Path(out), Path(work)
    # every shard is in place: a partial file of a killed (and retried) writer is now garbage
    remove(list(o.glob(PARTIAL_SHARD_GLOB)))
    concat_parts([scan_file(w, u, "quarantine.jsonl") for u in range(units)], o / sf.QUARANTINE_NAME)
    if dedup:
        concat_parts([bucket_file(w, b, "duplicates.jsonl") for b in range(num_buckets)], o / DUPLICATES_NAME)
    lengths_sha = None
    if text_tokens is not None:
        firsts = np.cumsum([0] + [n for _, n in shards])
        parts = [(int(f), shard_work_file(w, name, "lengths")) for f, (name, _) in zip(firsts, shards)]
        lengths_sha = write_length_index(o, parts, text_tokens)
    meta = build_index(o, [(name, n, shard_work_file(w, name, INDEX_PART)) for name, n in shards])
    return {"lengths_sha256": lengths_sha, "energon_meta": str(meta)}
