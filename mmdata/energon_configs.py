"""Which `.nv-meta/` dataset config of a shard folder our readers use, and the sample type it
names. Every shard set we write carries two (mmdata/shard_job/energon_meta.py):

    dataset.yaml   energon's standard `InterleavedSample`, built by a self-contained
                   `sample_loader.py`: what plain energon (`energon info/lint/preview`,
                   `get_train_dataset(DIR)`) reads, with or without mmdata installed;
    mmdata.yaml    our own sample types (ConversationSample, VQTokenSample), built by
                   `mmdata_sample_loader.py` from the installed package: what our loaders read.

A folder without `mmdata.yaml` (one `energon prepare` made, say) is read with its `dataset.yaml`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mmdata import shard_format as sf

#: energon's default dataset config (the portable one in shards we write)
ENERGON_DATASET_CONFIG = "dataset.yaml"
#: our sample types' dataset config, beside it (pass as energon's `dataset_config`)
MMDATA_DATASET_CONFIG = "mmdata.yaml"


def dataset_config(folder: str | Path) -> str:
    """The config file name our readers pass to energon for `folder`: `mmdata.yaml` when the
    folder has one, else energon's default `dataset.yaml`."""
    meta = Path(folder) / sf.ENERGON_META
    return MMDATA_DATASET_CONFIG if (meta / MMDATA_DATASET_CONFIG).is_file() else ENERGON_DATASET_CONFIG


def has_mmdata_config(folder: str | Path) -> bool:
    return (Path(folder) / sf.ENERGON_META / MMDATA_DATASET_CONFIG).is_file()


def config_sample_type(folder: str | Path) -> str | None:
    """ "module.Class" of the sample type in the config our readers use (`dataset_config`), or
    None when the folder has no readable one."""
    path = Path(folder) / sf.ENERGON_META / dataset_config(folder)
    try:
        doc = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None
    st = doc.get("sample_type") if isinstance(doc, dict) else None
    if isinstance(st, dict) and st.get("__class__"):
        return f"{st.get('__module__')}.{st['__class__']}" if st.get("__module__") else str(st["__class__"])
    return st if isinstance(st, str) and st else None
