"""Make a shard folder energon-ready: run energon's own preparation (tar indices, index.sqlite,
.info.json, split.yaml with every shard in `train`), then write dataset.yaml naming our
ConversationSample and the sample_loader.py that re-exports our loader."""

from __future__ import annotations

import contextlib
import importlib
import io
import threading
from pathlib import Path

import yaml

NV_META = ".nv-meta"
_ENERGON_PREPARE_MODULE = "megatron.energon.flavors.webdataset.base_webdataset"


def preload_energon() -> threading.Thread:
    """Import energon (and torch) in a background thread while the Ray stages run: the driver
    is idle then, and the import otherwise adds seconds to the finishing step."""
    t = threading.Thread(target=importlib.import_module, args=(_ENERGON_PREPARE_MODULE,), daemon=True)
    t.start()
    return t


def write_energon_meta(out_dir: Path, shard_names: list[str], workers: int = 1) -> None:
    # Imported here, not at module level: energon pulls in torch, and Ray workers running the
    # scan/sort/write stages import this package but never need it.
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    from mmdata.energon_loaders.sample import DATASET_YAML, SAMPLE_LOADER_PY

    if not shard_names:
        return
    with contextlib.redirect_stdout(io.StringIO()):
        BaseWebdatasetFactory.prepare_dataset(
            out_dir,
            list(shard_names),
            split_parts_ratio=[("train", 1.0)],
            shuffle_seed=None,  # our shards are already globally shuffled; keep their order
            workers=max(1, workers),
        )
    meta = out_dir / NV_META
    (meta / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER_PY)
