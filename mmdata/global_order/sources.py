"""The sources of a global order: one shard folder each, its samples' planned lengths, vision
tiles, global indices (energon's random access), keys, Emu3 variants and bytes in the tars, all
from the folder's length index and energon index, so the whole order is planned before a sample is
read.

A source is an endless stream of positions: position p is sample k = p % N of epoch e = p // N;
epoch 0 is the length index's order (the offline shuffle already shuffled it), epoch e > 0 the
permutation `default_rng([seed, source number, e])`. A position is the same sample at any layout.
"""

from __future__ import annotations

import os
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata.errors import UserError
from mmdata.packing.emu3 import token_plan_inputs
from mmdata.packing.emu3_geometry import Emu3PlanGeometry, index_meta
from mmdata.packing.geometry import PlanGeometry
from mmdata.packing.inputs import TEXT_TOKENS_META, image_plan_inputs, read_lengths
from mmdata.shard_job.lengths import LENGTHS_NAME

ENERGON_INDEX = Path(".nv-meta") / "index.sqlite"


@dataclass(frozen=True, eq=False)
class OrderSource:
    """One shard folder as the planner sees it (per sample, in the length index's order)."""

    name: str
    root: Path
    lengths: np.ndarray  # int64 tokens as the encoder produces them (Emu3: for the drawn variant)
    tiles: np.ndarray  # int64 vision tiles (0 for Emu3 and text)
    index: np.ndarray  # int64 global sample index in the shards (energon random access)
    keys: pa.Array | None  # sample keys where they are not f"{index:010d}"
    variants: np.ndarray | None  # int8 Emu3 task / caption-drop choice per sample
    sample_bytes: np.ndarray  # int64 bytes of each sample in its tar
    exact: bool  # lengths counted with the tokenizer (not estimated)

    def __len__(self) -> int:
        return len(self.lengths)

    def key(self, k: int) -> str:
        """The key of sample k (in the length index's order)."""
        return self.keys[k].as_py() if self.keys is not None else f"{int(self.index[k]):010d}"

    def variant(self, k: int) -> int | None:
        return None if self.variants is None else int(self.variants[k])

    @classmethod
    def from_arrays(cls, name: str, lengths: np.ndarray, tiles: np.ndarray | None = None) -> OrderSource:
        """A source of samples known only by their lengths (tests, benchmarks, simulations)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        tiles = np.zeros(n, np.int64) if tiles is None else np.asarray(tiles, dtype=np.int64)
        return cls(
            name, Path(name), lengths, tiles, np.arange(n, dtype=np.int64), None, None, np.zeros(n, np.int64), True
        )


def load_source(
    root: Path | str,
    name: str | None = None,
    geometry: PlanGeometry | Emu3PlanGeometry | None = None,
    tokenizer: str | Path | None = None,
    seed: int = 0,
) -> OrderSource:
    """The source of a shard folder, from its length index (through the plan's own input
    functions: image shards' totals or recounted media, Emu3 variants drawn once with `seed`) and
    its energon index (each sample's bytes)."""
    root = Path(root)
    try:
        table = read_lengths(root)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if index_meta(table).get("kind") is not None:  # Emu3 token shards (mmdata tokenize-images --tokenizer)
        inputs = token_plan_inputs(root, table, geometry, tokenizer, seed)
        exact = True
    else:
        inputs = image_plan_inputs(root, table, geometry)
        exact = inputs.meta.get("text_tokens") != "estimate"
    columns = inputs.columns or {}
    keys = columns.get("key")
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    variants = columns.get("variant")
    index = np.asarray(inputs.index, dtype=np.int64)
    return OrderSource(
        name or source_name(root),
        root,
        np.asarray(inputs.lengths, dtype=np.int64),
        np.asarray(inputs.tiles, dtype=np.int64),
        index,
        keys,
        None if variants is None else np.asarray(variants, dtype=np.int8),
        sample_bytes(root, index),
        exact,
    )


def estimated_lengths_problem(root: Path | str) -> str | None:
    """Why the global order should not plan from this folder (None where its lengths are exact):
    text lengths estimated without the tokenizer (`mmdata preprocess` without --tokenizer) make
    samples overflow their planned rows, and a sample carried when a checkpoint is saved is not in
    the layout-free document, so it trains again only in a later epoch. Read from the length
    index's schema alone (its absence is refused where the sources are loaded)."""
    path = Path(root) / LENGTHS_NAME
    if not path.is_file() or (pq.read_schema(path).metadata or {}).get(TEXT_TOKENS_META) != b"estimate":
        return None
    return (
        f"{root} has estimated text lengths (preprocessed without --tokenizer): data.sharding: global "
        "plans rows the samples overflow, and a sample carried at a checkpoint trains only in a later epoch; "
        "fix: `mmdata preprocess --tokenizer DIR` (the training tokenizer), or set "
        "data.plan_allow_estimated_lengths: true to accept it"
    )


def source_name(root: Path | str) -> str:
    """A folder's name as the user wrote it: the last component of its absolute path, symlinks not
    followed (a link names its source, so linking a folder under another name renames it)."""
    return Path(os.path.abspath(root)).name


def sample_bytes(root: Path, index: np.ndarray) -> np.ndarray:
    """Bytes in the folder's tars of the samples at global `index` (energon's index.sqlite,
    `samples.byte_size`): one query in energon's global order (tar, then sample in the tar: its
    `idx_samples_by_tar_and_idx`) read straight into an array, no key strings (10^8 samples:
    8 bytes each). Keys are checked where the samples are read (random_access.ShardReader)."""
    path = root / ENERGON_INDEX
    if not path.is_file():
        raise UserError(f"{path} not found: the folder is not energon-ready; rerun `mmdata preprocess` (it writes it)")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        (count,) = db.execute("SELECT COUNT(*) FROM samples").fetchone()
        rows = db.execute("SELECT COALESCE(byte_size, 0) FROM samples ORDER BY tar_file_id, sample_index")
        sizes = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=count)
    index = np.asarray(index, dtype=np.int64)
    if len(index) and (index.min() < 0 or index.max() >= count):
        raise UserError(
            f"{path} holds {count} samples, the length index names sample {int(index.max())}: "
            "the length index and the shards disagree; rerun the job that wrote the folder"
        )
    return sizes[index]


def check_names(sources: list[OrderSource]) -> None:
    """Refuse sources without distinct names (the blend and the ledger name them)."""
    if not sources:
        raise UserError("a global order needs at least one source: list the shard folders in data.paths")
    seen: set[str] = set()
    for s in sources:
        if s.name in seen:
            raise UserError(
                f"two data sources are named {s.name!r} ({s.root}): give the folders distinct basenames or names"
            )
        if len(s) == 0:
            raise UserError(f"data source {s.name!r} ({s.root}) has no samples to train")
        seen.add(s.name)


class Streams:
    """Position -> sample number of each source (epoch permutations cached, a few at a time)."""

    CACHED = 8

    def __init__(self, sources: list[OrderSource], seed: int) -> None:
        self.sources, self.seed = sources, seed
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        hit = self._perms.get((s, epoch))
        if hit is None:
            hit = np.random.default_rng([self.seed, s, epoch]).permutation(len(self.sources[s]))
            self._perms[(s, epoch)] = hit
            if len(self._perms) > self.CACHED:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end((s, epoch))
        return hit

    def samples(self, s: int, positions: np.ndarray) -> np.ndarray:
        """Sample numbers (into source s's arrays) of its stream `positions` (int64)."""
        positions = np.asarray(positions, dtype=np.int64)
        n = len(self.sources[s])
        epoch, k = np.divmod(positions, n)
        out = k.copy()
        for e in np.unique(epoch):
            if e > 0:
                m = epoch == e
                out[m] = self._perm(s, int(e))[k[m]]
        return out

    def sample(self, s: int, position: int) -> int:
        e, k = divmod(int(position), len(self.sources[s]))
        return k if e == 0 else int(self._perm(s, e)[k])
