"""The sources of a global order: one shard folder each, its samples' planned lengths, vision
tiles, global indices (energon's random access), keys, Emu3 variant choices and bytes in the
tars, all from the folder's length index and energon index, so the whole order is planned before a
sample is read.

A source is an endless stream of positions: position p is sample k = p % N of epoch e = p // N;
epoch 0 is the length index's order (the offline shuffle already shuffled it), epoch e > 0 the
permutation `default_rng([seed, source number, e])`. An Emu3 sample's task and caption drop are
drawn per epoch, as the encoder draws them at each encode with `data.sharding: dp`: from
`default_rng([seed, source number, VARIANT_STREAM, e])`, one pair of uniforms per sample number k,
so the same image is not unconditional in every epoch. A position is the same sample, in the same
variant, at any layout.
"""

from __future__ import annotations

import os
import sqlite3
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmdata.errors import UserError
from mmdata.packing.emu3 import token_variant_choices
from mmdata.packing.emu3_geometry import Emu3PlanGeometry, VariantChoices, index_meta
from mmdata.packing.geometry import PlanGeometry
from mmdata.packing.inputs import TEXT_TOKENS_META, image_plan_inputs, read_lengths
from mmdata.shard_job.lengths import LENGTHS_NAME

ENERGON_INDEX = Path(".nv-meta") / "index.sqlite"
VARIANT_BLOCK = 1 << 20  # samples whose variants are drawn at once
VARIANT_STREAM = 0xE3  # an Emu3 source's variants of epoch e: default_rng([seed, source, VARIANT_STREAM, e])


@dataclass(frozen=True, eq=False)
class OrderSource:
    """One shard folder as the planner sees it (per sample, in the length index's order)."""

    name: str
    root: Path
    lengths: np.ndarray  # int64 tokens as the encoder produces them (Emu3: the mean over its variants)
    tiles: np.ndarray  # int64 vision tiles (0 for Emu3 and text)
    index: np.ndarray  # int64 global sample index in the shards (energon random access)
    keys: pa.Array | None  # sample keys where they are not f"{index:010d}"
    choices: VariantChoices | None  # Emu3: each sample's variants, drawn per epoch (`Streams.variants`)
    sample_bytes: np.ndarray  # int64 bytes of each sample in its tar
    exact: bool  # lengths counted with the tokenizer (not estimated)

    def __len__(self) -> int:
        return len(self.lengths)

    def key(self, k: int) -> str:
        """The key of sample k (in the length index's order)."""
        return self.keys[k].as_py() if self.keys is not None else f"{int(self.index[k]):010d}"

    @classmethod
    def from_arrays(
        cls, name: str, lengths: np.ndarray, tiles: np.ndarray | None = None, choices: VariantChoices | None = None
    ) -> OrderSource:
        """A source of samples known only by their lengths (tests, benchmarks, simulations)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        tiles = np.zeros(n, np.int64) if tiles is None else np.asarray(tiles, dtype=np.int64)
        return cls(
            name, Path(name), lengths, tiles, np.arange(n, dtype=np.int64), None, choices, np.zeros(n, np.int64), True
        )


def load_source(
    root: Path | str,
    name: str | None = None,
    geometry: PlanGeometry | Emu3PlanGeometry | None = None,
    tokenizer: str | Path | None = None,
    seed: int = 0,
) -> OrderSource:
    """The source of a shard folder, from its length index (through the plan's own input
    functions: image shards' totals or recounted media, Emu3 variant choices) and its energon
    index (each sample's bytes). `seed` is the order's: the draws are `Streams`'."""
    root = Path(root)
    try:
        table = read_lengths(root)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    choices: VariantChoices | None = None
    if index_meta(table).get("kind") is not None:  # Emu3 token shards (mmdata tokenize-images --tokenizer)
        keep, choices = token_variant_choices(root, table, geometry, tokenizer)
        lengths, tiles, exact = choices.expected_lengths(), np.zeros(len(choices), np.int64), True
        index, keys = table.column("index").to_numpy()[keep], table.column("key").filter(keep)
    else:
        inputs = image_plan_inputs(root, table, geometry)
        lengths, tiles, index = inputs.lengths, inputs.tiles, inputs.index
        exact = inputs.meta.get("text_tokens") != "estimate"
        keys = (inputs.columns or {}).get("key")
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    index = np.asarray(index, dtype=np.int64)
    return OrderSource(
        name or source_name(root),
        root,
        np.asarray(lengths, dtype=np.int64),
        np.asarray(tiles, dtype=np.int64),
        index,
        keys,
        choices,
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
    """Position -> sample number of each source, and an Emu3 sample's variant in its epoch (epoch
    permutations and variants cached, a few at a time)."""

    CACHED = 8

    def __init__(self, sources: list[OrderSource], seed: int) -> None:
        self.sources, self.seed = sources, seed
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        return self._cached(
            ("perm", s, epoch), lambda: np.random.default_rng([self.seed, s, epoch]).permutation(len(self.sources[s]))
        )

    def _variants(self, s: int, epoch: int) -> np.ndarray:
        """Source s's variant of every sample number in `epoch` (it must have choices)."""
        choices = self.sources[s].choices
        assert choices is not None

        def draw() -> np.ndarray:  # in blocks: 16 bytes of uniforms per sample at a time is too many
            rng, out = np.random.default_rng([self.seed, s, VARIANT_STREAM, epoch]), np.empty(len(choices), np.int8)
            for a in range(0, len(out), VARIANT_BLOCK):
                b = min(len(out), a + VARIANT_BLOCK)
                out[a:b] = choices.draw(rng.random((b - a, 2)), slice(a, b))
            return out

        return self._cached(("variant", s, epoch), draw)

    def _cached(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = make()
            if len(self._cache) > 2 * self.CACHED:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return hit

    def variants(self, s: int, positions: np.ndarray) -> np.ndarray | None:
        """The Emu3 variants (int8) of source s's stream `positions`; None for a source without."""
        if self.sources[s].choices is None:
            return None
        positions = np.asarray(positions, dtype=np.int64)
        epoch = positions // len(self.sources[s])
        samples, out = self.samples(s, positions), np.empty(len(positions), np.int8)
        for e in np.unique(epoch):
            m = epoch == e
            out[m] = self._variants(s, int(e))[samples[m]]
        return out

    def lengths(self, s: int, positions: np.ndarray) -> np.ndarray:
        """The planned lengths (int64) at source s's stream `positions`: an Emu3 sample's for the
        variant drawn in its epoch."""
        source, samples = self.sources[s], self.samples(s, positions)
        variants = self.variants(s, positions)
        if variants is None:
            return source.lengths[samples]
        return source.choices.lengths[samples, variants].astype(np.int64)

    def variant(self, s: int, position: int) -> int | None:
        out = self.variants(s, np.asarray([position]))
        return None if out is None else int(out[0])

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
