"""Is a data path ready to read? One answer for `mmdata inspect`/`preview`, the energon loaders
and `mmtrain`'s checks before training, so none of them reads a half-written dataset.

A shard folder is ready when its writer finished: `mmdata preprocess` and `tokenize-images`
keep their state in `DIR/.mmdata-work/` and publish `.nv-meta/` and then `manifest.json` last,
so a work folder without a manifest is an unfinished (interrupted, failed or running) job. Such
a folder is refused, and so is a folder without energon metadata or without samples; a
metadataset YAML is ready when every dataset it names is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from mmdata import shard_format as sf
from mmdata.energon_configs import MMDATA_DATASET_CONFIG, has_mmdata_config
from mmdata.errors import UserError

INFO_JSON = ".info.json"  # energon's per-shard sample counts, inside .nv-meta/


class DatasetNotReady(UserError):
    """A data path that cannot be read as a finished dataset (the message says why and what to do)."""


def unfinished_job(folder: Path) -> str | None:
    """Why `folder` holds an unfinished job's output, or None."""
    work = folder / sf.WORK_DIR_NAME
    if not work.is_dir() or (folder / sf.MANIFEST_NAME).is_file():
        return None
    tool = "mmdata preprocess"
    try:
        tool = json.loads((work / "work.json").read_text()).get("tool") or tool
    except (OSError, ValueError):
        pass
    return (
        f"{folder} holds an unfinished `{tool}` job ({sf.WORK_DIR_NAME}/ without {sf.MANIFEST_NAME}): "
        "rerun the same command to finish it"
    )


def dataset_samples(folder: Path) -> int:
    """Samples in a finished energon shard folder (from energon's .info.json); DatasetNotReady otherwise."""
    if not folder.exists():
        raise DatasetNotReady(f"{folder} does not exist")
    if not folder.is_dir():
        raise DatasetNotReady(f"{folder} is a file, not a shard folder or metadataset YAML")
    if (why := unfinished_job(folder)) is not None:
        raise DatasetNotReady(why)
    info = folder / sf.ENERGON_META / INFO_JSON
    if not info.is_file():
        raise DatasetNotReady(
            f"{folder} is not an energon dataset (no {sf.ENERGON_META}/{INFO_JSON}); write it with "
            "`mmdata preprocess`, or `energon prepare` for shards made elsewhere"
        )
    try:
        counts = json.loads(info.read_text()).get("shard_counts") or {}
        samples = sum(int(v) for v in counts.values())
    except (ValueError, TypeError, AttributeError):
        raise DatasetNotReady(f"{info} is not energon's .info.json (unreadable shard counts)") from None
    if samples <= 0:
        raise DatasetNotReady(f"{folder} holds 0 samples")
    return samples


def data_source_samples(path: str | Path) -> list[int]:
    """Samples of each dataset a data path reads: a shard folder, or every dataset named by a
    metadataset YAML (energon's `path:` entries, relative to the YAML's folder)."""
    p = Path(path)
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        return _metadataset_samples(p)
    return [dataset_samples(p)]


def _metadataset_samples(yaml_path: Path, depth: int = 0) -> list[int]:
    try:
        doc = yaml.safe_load(yaml_path.read_text())
    except yaml.YAMLError as err:
        raise DatasetNotReady(f"{yaml_path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(doc, dict) or "Metadataset" not in str(doc.get("__class__", "")):
        raise DatasetNotReady(f"{yaml_path} is not an energon metadataset (no `__class__: MetadatasetV2`)")
    refs = list(_refs_in(doc))
    if not refs:
        raise DatasetNotReady(f"{yaml_path} names no dataset (no `path:` entries)")
    samples: list[int] = []
    for ref in refs:
        rel = ref["path"]
        target = (yaml_path.parent / rel) if not Path(rel).is_absolute() else Path(rel)
        try:
            if target.is_file() and target.suffix in (".yaml", ".yml") and depth < 8:
                samples += _metadataset_samples(target, depth + 1)
            else:
                samples.append(dataset_samples(target))
                _check_dataset_config(ref, target)
        except DatasetNotReady as err:
            raise DatasetNotReady(f"{yaml_path}: {err}") from None
    return samples


def _check_dataset_config(ref: dict, folder: Path) -> None:
    """A metadataset entry of a shard folder with our `mmdata.yaml` must read it: without
    `dataset_config`, energon reads `dataset.yaml`, whose InterleavedSample (for loaders without
    mmdata) no mmdata task encoder takes."""
    if has_mmdata_config(folder) and ref.get("dataset_config") != MMDATA_DATASET_CONFIG:
        raise DatasetNotReady(
            f"the entry of {ref['path']} reads `{ref.get('dataset_config') or 'dataset.yaml'}` "
            f"(energon's InterleavedSample): add `dataset_config: {MMDATA_DATASET_CONFIG}` to it "
            "so the mmdata loaders get their sample type"
        )


def _refs_in(node: Any):
    """Every mapping with a string `path:` (a dataset or nested metadataset reference), in order."""
    if isinstance(node, dict):
        if isinstance(node.get("path"), str):
            yield node
        for key, value in node.items():
            if key != "path":
                yield from _refs_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs_in(item)
