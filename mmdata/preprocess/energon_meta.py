"""Make a shard folder energon-ready: `.nv-meta/` (index.sqlite, index.uuid, .info.json,
split.yaml with every shard in `train`, dataset.yaml naming our ConversationSample, the
sample_loader.py that re-exports our loader) and one `.tar.idx` per shard.

The files are written from the `ShardLayout` the shard writer recorded while writing, with
energon's own index writer and config classes, rather than by energon's `prepare_dataset`,
which reads every shard back: that extra pass cost the driver as much time as the whole write
stage. tests/test_energon_index.py checks the result equals `prepare_dataset`'s, file by file.
"""

from __future__ import annotations

import importlib
import json
import struct
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

NV_META = ".nv-meta"
TAR_INDEX_SUFFIX = ".tar.idx"  # energon's ITAR_SUFFIX
_ENERGON_PREPARE_MODULE = "megatron.energon.flavors.webdataset.base_webdataset"


@dataclass
class ShardLayout:
    """Where the samples and members of one written shard lie, i.e. what energon's preparation
    would find by reading the tar: header offset of each sample's first member, each member's
    data offset and size, and the offset where the end-of-archive blocks start."""

    samples: list[tuple[str, int]]  # (sample key, header offset)
    parts: list[tuple[int, str, int, int]]  # (sample index, part name, data offset, size)
    end: int

    def to_json(self) -> str:
        return json.dumps({"samples": self.samples, "parts": self.parts, "end": self.end})

    @classmethod
    def from_json(cls, text: str) -> ShardLayout:
        d = json.loads(text)
        return cls([tuple(s) for s in d["samples"]], [tuple(p) for p in d["parts"]], d["end"])


def write_tar_index(tar_path: Path, layout: ShardLayout) -> None:
    """energon's `<shard>.tar.idx`: native u64 header offsets of every sample, then the end."""
    offsets = [off for _, off in layout.samples] + [layout.end]
    tmp = tar_path.with_name(tar_path.name + ".idx.tmp")
    tmp.write_bytes(struct.pack(f"{len(offsets)}Q", *offsets))
    tmp.replace(tar_path.with_name(tar_path.name[: -len(".tar")] + TAR_INDEX_SUFFIX))


def preload_energon() -> threading.Thread:
    """Import energon (and torch) in a background thread while the Ray stages run: the driver
    is idle then, and the import otherwise adds seconds to the finishing step."""
    t = threading.Thread(target=importlib.import_module, args=(_ENERGON_PREPARE_MODULE,), daemon=True)
    t.start()
    return t


def write_energon_index(out_dir: Path, shard_names: list[str], layouts: Iterable[ShardLayout]) -> None:
    """What `prepare_dataset` writes for these shards (split `train` = all, in order), from
    their recorded layouts; the `.tar.idx` files are written by the shard writers themselves.
    Layouts are consumed one shard at a time, so memory does not grow with the dataset."""
    from megatron.energon import __version__ as energon_version
    from megatron.energon.bracecollapse import collapse
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.config import INDEX_SQLITE_FILENAME, INDEX_UUID_FILENAME, INFO_JSON_FILENAME
    from megatron.energon.flavors.webdataset.indexing import SqliteIndexWriter
    from megatron.energon.flavors.webdataset.prepare import IndexSample, IndexSamplePart
    from megatron.energon.flavors.webdataset.structs import WebdatasetInfo, WebdatasetSplits
    from megatron.energon.typed_converter import to_json_object

    if not shard_names:
        return
    meta = out_dir / NV_META
    meta.mkdir(exist_ok=True)
    sqlite_path = meta / INDEX_SQLITE_FILENAME
    sqlite_path.unlink(missing_ok=True)
    writer = SqliteIndexWriter(EPath(sqlite_path))
    counts: dict[str, int] = {}
    for tar_id, (name, layout) in enumerate(zip(shard_names, layouts, strict=True)):
        starts = [off for _, off in layout.samples] + [layout.end]
        writer.append_samples([IndexSample(tar_file_id=tar_id, sample_key=key, sample_index=i, byte_offset=off,
                                           byte_size=starts[i + 1] - off)
                               for i, (key, off) in enumerate(layout.samples)])
        writer.append_parts([IndexSamplePart(tar_file_id=tar_id, sample_index=i, part_name=part,
                                             content_byte_offset=off, content_byte_size=size)
                             for i, part, off, size in layout.parts])
        counts[name] = len(layout.samples)
    writer.close()
    (meta / INDEX_UUID_FILENAME).write_text(str(uuid.uuid4()))
    info = WebdatasetInfo(energon_version=energon_version, shard_counts=counts)
    (meta / INFO_JSON_FILENAME).write_text(json.dumps(to_json_object(info), indent=2))
    splits = WebdatasetSplits(split_parts={"train": collapse(list(shard_names), keep_order=True)})
    (meta / "split.yaml").write_text(yaml.dump(to_json_object(splits), sort_keys=False))
    _write_dataset_yaml(out_dir)


def _write_dataset_yaml(out_dir: Path) -> None:
    from mmdata.energon_loaders.sample import DATASET_YAML, SAMPLE_LOADER_PY

    meta = out_dir / NV_META
    (meta / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER_PY)
