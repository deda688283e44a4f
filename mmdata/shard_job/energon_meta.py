"""Make a shard folder energon-ready: `.nv-meta/` (index.sqlite, index.uuid, .info.json,
split.yaml with every shard in `train` and empty `val`/`test`, the two dataset configs below)
and one `.tar.idx` per shard.

Two dataset configs (mmdata/energon_configs.py says which our readers pick):
  - `dataset.yaml`, energon's default: the standard `megatron.energon.InterleavedSample`, built
    by a self-contained `sample_loader.py` (a copy of energon_sample_loader.py, no mmdata
    import), so plain energon reads our shards where mmdata is not installed;
  - `mmdata.yaml`: our sample type (ConversationSample, or VQTokenSample for token shards),
    built by `mmdata_sample_loader.py`, which re-exports the installed package's loader.

Written from the `ShardLayout` each shard writer recorded while writing, not by energon's
`prepare_dataset`: that reads every shard back (as costly as the whole write stage) and
importing energon (torch) costs the driver ~3 CPU-seconds, a fifth of a 16k-record job on 2
cores. The files follow the formats of energon `ENERGON_FORMAT_VERSION` (index schema of
`SqliteIndexWriter`, `.tar.idx` of `TarIndexWriter`, split.yaml, .info.json);
tests/test_energon_index.py checks they equal the installed energon's `prepare_dataset` output.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

from mmdata import shard_format as sf
from mmdata.energon_configs import ENERGON_DATASET_CONFIG, MMDATA_DATASET_CONFIG

NV_META = sf.ENERGON_META
TAR_INDEX_SUFFIX = ".tar.idx"  # energon's ITAR_SUFFIX
INDEX_PART = "index.sqlite"  # a written shard's rows of index.sqlite: its work file (shard_work_file)
EMPTY_SPLIT_PARTS = ("val", "test")  # in split.yaml, empty: energon's tools visit them by default

#: The energon release whose on-disk formats this module writes, stamped as `energon_version`
#: in `.info.json` (the schema we write, not whatever energon happens to be installed).
#: tests/test_energon_index.py fails when the installed energon's minor version differs: then
#: compare our files with its `prepare_dataset` output again and update this.
ENERGON_FORMAT_VERSION = "7.4.1"

#: (module, class) of the sample type `mmdata.yaml` names for preprocess output
CONVERSATION_SAMPLE_TYPE = ("mmdata.energon_loaders.sample", "ConversationSample")

SAMPLE_LOADER_NAME = "sample_loader.py"  # the self-contained loader of dataset.yaml
MMDATA_SAMPLE_LOADER_NAME = "mmdata_sample_loader.py"  # the loader of mmdata.yaml
_PORTABLE_LOADER_SOURCE = Path(__file__).with_name("energon_sample_loader.py")

#: `.nv-meta/dataset.yaml`: energon's own sample type, readable without mmdata
DATASET_YAML = {
    "sample_type": {"__module__": "megatron.energon", "__class__": "InterleavedSample"},
    "sample_loader": f"{SAMPLE_LOADER_NAME}:sample_loader",
    "part_filter": f"{SAMPLE_LOADER_NAME}:part_filter",
}


def mmdata_dataset_yaml(sample_type: tuple[str, str] = CONVERSATION_SAMPLE_TYPE) -> dict:
    """`.nv-meta/mmdata.yaml`: our sample type, built by the installed package's loader."""
    module, cls = sample_type
    return {
        "sample_type": {"__module__": module, "__class__": cls},
        "sample_loader": f"{MMDATA_SAMPLE_LOADER_NAME}:sample_loader",
        "part_filter": f"{MMDATA_SAMPLE_LOADER_NAME}:part_filter",
    }


def mmdata_sample_loader_py(sample_type: tuple[str, str] = CONVERSATION_SAMPLE_TYPE) -> str:
    """The text of `.nv-meta/mmdata_sample_loader.py`."""
    return (
        "# Written by mmdata: the loader of mmdata.yaml lives in the installed package (dataset.yaml\n"
        "# and sample_loader.py read these shards without it).\n"
        f"from {sample_type[0]} import part_filter, sample_loader  # noqa: F401\n"
    )


# energon's index.sqlite schema (megatron/energon/flavors/webdataset/indexing.py).
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE, "
    "sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER)",
    "CREATE TABLE IF NOT EXISTS sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT, "
    "content_byte_offset INTEGER, content_byte_size INTEGER)",
)
_INDEXES = (  # created after the inserts, as energon does
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
    "content_byte_offset, content_byte_size)",
)


@dataclass
class ShardLayout:
    """Where the samples and members of one written shard lie, i.e. what energon's preparation
    would find by reading the tar: header offset of each sample's first member, each member's
    data offset and size, and the offset where the end-of-archive blocks start."""

    samples: list[tuple[str, int]]  # (sample key, header offset)
    parts: list[tuple[int, str, int, int]]  # (sample index, part name, data offset, size)
    end: int

    def to_json(self) -> str:
        """(orjson: a shard's layout has an entry per member, and json.dumps of it cost the write
        stage about 2 CPU-us per sample; `json` for names orjson cannot write, e.g. surrogate
        escapes of undecodable member names.)"""
        layout = {"samples": self.samples, "parts": self.parts, "end": self.end}
        try:
            return orjson.dumps(layout).decode()
        except TypeError:
            return json.dumps(layout)

    @classmethod
    def from_json(cls, text: str) -> ShardLayout:
        try:
            d = orjson.loads(text)
        except orjson.JSONDecodeError:  # (json's escapes of surrogates, which orjson refuses)
            d = json.loads(text)
        return cls([tuple(s) for s in d["samples"]], [tuple(p) for p in d["parts"]], d["end"])


def write_tar_index(tar_path: Path, layout: ShardLayout) -> None:
    """energon's `<shard>.tar.idx`: native u64 header offsets of every sample, then the end."""
    offsets = [off for _, off in layout.samples] + [layout.end]
    tmp = tar_path.with_name(tar_path.name + ".idx.tmp")
    tmp.write_bytes(struct.pack(f"{len(offsets)}Q", *offsets))
    tmp.replace(tar_path.with_name(tar_path.name[: -len(".tar")] + TAR_INDEX_SUFFIX))


class EnergonIndexWriter:
    """What `prepare_dataset` writes for a shard set (split `train` = all of them, in order;
    `val` and `test` empty),
    built one shard at a time from the layouts the shard writers recorded: `add` each shard in
    order (the job does it as shards finish, while later ones are still being written), then
    `finish`. The `.tar.idx` files are written by the shard writers. `sample_type`: (module,
    class) that `mmdata.yaml` names (default ConversationSample).

    Built in a temporary folder and published atomically by `finish`: energon takes a folder with
    `.nv-meta/` for a dataset, so it never sees a partial one. That is also why the database is
    written without a rollback journal or fsyncs: a build that dies leaves only the temporary
    folder, which the next run removes and rebuilds. The inserts are one transaction, so the
    same shards give the same bytes."""

    def __init__(self, out_dir: Path, sample_type: tuple[str, str] = CONVERSATION_SAMPLE_TYPE):
        self.out_dir, self.sample_type = Path(out_dir), tuple(sample_type)
        self.meta = self.out_dir / f"{NV_META}.tmp-{os.getpid()}"
        self.counts: dict[str, int] = {}  # shard name -> samples, in add order
        self._db: sqlite3.Connection | None = None

    def _open(self) -> sqlite3.Connection:
        shutil.rmtree(self.meta, ignore_errors=True)
        self.meta.mkdir()
        # (the connection is used by whichever single thread adds and finishes)
        db = sqlite3.connect(self.meta / "index.sqlite", check_same_thread=False)
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        for ddl in _SCHEMA:
            db.execute(ddl)
        return db

    def add_part(self, name: str, samples: int, part: Path) -> None:
        """Index the next shard from the part its writer saved (`write_index_part`): copied in
        SQLite's C code (ATTACH + INSERT ... SELECT), in the part's row order, so the result is the
        same as `add` of its layout, at a fraction of the CPU."""
        if name in self.counts:
            raise ValueError(f"{name}: already in the index")
        if self._db is None:
            self._db = self._open()
        db, tar_id = self._db, len(self.counts)
        db.commit()  # (ATTACH cannot run inside a transaction)
        db.execute("ATTACH DATABASE ? AS part", (str(part),))
        db.execute(
            "INSERT INTO samples SELECT ?, sample_key, sample_index, byte_offset, byte_size FROM part.samples "
            "ORDER BY rowid",
            (tar_id,),
        )
        db.execute(
            "INSERT INTO sample_parts SELECT ?, sample_index, part_name, content_byte_offset, content_byte_size "
            "FROM part.sample_parts ORDER BY rowid",
            (tar_id,),
        )
        db.commit()
        db.execute("DETACH DATABASE part")
        self.counts[name] = samples

    def add(self, name: str, layout: ShardLayout) -> None:
        """Index the next shard (shards are added in their split order)."""
        if name in self.counts:
            raise ValueError(f"{name}: already in the index")
        if self._db is None:
            self._db = self._open()
        _insert_rows(self._db, len(self.counts), layout)
        self.counts[name] = len(layout.samples)

    def finish(self, publish: bool = True) -> Path | None:
        """Create the indexes, write the other files and publish `.nv-meta/` (nothing when no
        shard was added). `publish=False` leaves the finished folder under its temporary name
        (returned) for `publish_index`: a Ray task builds it, the driver publishes it."""
        if self._db is None:
            return None
        for ddl in _INDEXES:
            self._db.execute(ddl)
        self._db.commit()
        self._db.close()
        self._db = None
        meta, names = self.meta, list(self.counts)
        (meta / "index.uuid").write_text(str(uuid.uuid4()))
        info = {"energon_version": ENERGON_FORMAT_VERSION, "shard_counts": self.counts}
        (meta / ".info.json").write_text(json.dumps(info, indent=2))
        (meta / "split.yaml").write_text(yaml.dump(split_config(names), sort_keys=False))
        (meta / ENERGON_DATASET_CONFIG).write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
        (meta / SAMPLE_LOADER_NAME).write_text(_PORTABLE_LOADER_SOURCE.read_text())
        (meta / MMDATA_DATASET_CONFIG).write_text(
            yaml.safe_dump(mmdata_dataset_yaml(self.sample_type), sort_keys=False)
        )
        (meta / MMDATA_SAMPLE_LOADER_NAME).write_text(mmdata_sample_loader_py(self.sample_type))
        if publish:
            publish_index(self.out_dir, meta)
        return meta


def build_index(
    out_dir: Path, parts: list[tuple[str, int, Path]], sample_type: tuple[str, str] = CONVERSATION_SAMPLE_TYPE
) -> Path | None:
    """(in a Ray task) `.nv-meta` for the shards `parts` [(name, samples, index part)], in that
    order, left under its temporary name (returned; None without shards) for `publish_index`."""
    index = EnergonIndexWriter(out_dir, sample_type)
    for name, samples, part in parts:
        index.add_part(name, samples, part)
    return index.finish(publish=False)


def publish_index(out_dir: Path, meta: Path) -> None:
    """Put a finished `.nv-meta` folder built under a temporary name in place (atomically)."""
    final = Path(out_dir) / NV_META
    if final.exists():  # from an interrupted finish of this same job
        shutil.rmtree(final)
    os.replace(meta, final)


def write_index_part(path: Path, layout: ShardLayout) -> None:
    """One shard's rows of energon's index (tar_file_id 0; `add_part` sets the shard's), saved
    by its writer task: the per-sample inserts then run on the cluster, not in the driver."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(tmp)
    try:
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        for ddl in _SCHEMA:
            db.execute(ddl.replace(" UNIQUE", ""))  # (the merged index enforces it)
        _insert_rows(db, 0, layout)
        db.commit()
    finally:
        db.close()
    os.replace(tmp, path)


def read_index_part(path: Path) -> ShardLayout:
    """The layout a shard's index part holds (what its writer recorded): for checks."""
    with sqlite3.connect(path) as db:
        samples = db.execute("SELECT sample_key, byte_offset, byte_size FROM samples ORDER BY rowid").fetchall()
        parts = db.execute("SELECT sample_index, part_name, content_byte_offset, content_byte_size FROM sample_parts")
        layout = ShardLayout([(k, off) for k, off, _ in samples], [tuple(p) for p in parts.fetchall()], 0)
    layout.end = samples[-1][1] + samples[-1][2] if samples else 0
    return layout


def _insert_rows(db: sqlite3.Connection, tar_id: int, layout: ShardLayout) -> None:
    ends = [off for _, off in layout.samples[1:]] + [layout.end]
    db.executemany(
        "INSERT INTO samples VALUES (?, ?, ?, ?, ?)",
        ((tar_id, key, i, off, end - off) for i, ((key, off), end) in enumerate(zip(layout.samples, ends))),
    )
    db.executemany("INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)", ((tar_id, *part) for part in layout.parts))


def write_energon_index(
    out_dir: Path,
    shard_names: list[str],
    layouts: Iterable[ShardLayout],
    sample_type: tuple[str, str] = CONVERSATION_SAMPLE_TYPE,
) -> None:
    """`.nv-meta/` for these shards from their layouts (see EnergonIndexWriter). Layouts are
    consumed one shard at a time, so memory does not grow with the dataset."""
    index = EnergonIndexWriter(out_dir, sample_type)
    for name, layout in zip(shard_names, layouts, strict=True):
        index.add(name, layout)
    index.finish()


def split_config(shard_names: list[str]) -> dict:
    """split.yaml: every shard in `train`, and `val`/`test` present but empty, as energon's own
    `energon prepare --split-ratio 1,0,0` writes it. energon's tools (`energon lint`, `energon
    preview`) visit `train,val,test` by default: a missing part is an `AssertionError: Invalid
    split part`, an empty one is skipped as empty."""
    return {"split_parts": {"train": _collapse(shard_names), **{part: [] for part in EMPTY_SPLIT_PARTS}}, "exclude": []}


def _collapse(shard_names: list[str]) -> list[str]:
    """Contiguous shard-000000.tar ... as one brace range (energon expands it, and writes it so)."""
    n = len(shard_names)
    if n < 2 or shard_names != [sf.SHARD_NAME_TEMPLATE.format(i) for i in range(n)]:
        return list(shard_names)
    return [sf.SHARD_NAME_TEMPLATE.replace("{:06d}", f"{{{0:06d}..{n - 1:06d}}}")]
