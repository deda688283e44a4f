"""The image area an Emu3 checkpoint was trained at, for its HF export's `preprocessor_config.json`.

`mmdata tokenize-images --image-area N` resizes every image to about N pixels before the VQ
encodes it, and records N in the token shards' manifest. The VQ dir's own processor config keeps
its default bounds (Emu3-Chat's 512x512 for the tiny VQ too): an export that copied it unchanged
would make transformers' `Emu3Processor` turn a 64x64 image into a prompt of another length than
the model was trained on (4,174 tokens for a 4,096-position model, with no warning).

A trained checkpoint records its data paths (`trainer_state.json`, `data.paths`: the loader's
identity, mmtrain/runtime/checkpoint/data_identity.py); their manifests give the area, which the
export writes as the processor's min/max pixels - what `mmdata.vision_tokens.vq.load_image_processor`
does when tokenizing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mmdata.shard_format import MANIFEST_NAME
from mmtrain.runtime.checkpoint.layout import TRAINER_STATE, iter_dir, read_latest

log = logging.getLogger(__name__)

#: the token-shard manifest's key (mmdata/vision_tokens/job.py): pixels, or null for the VQ's own bounds
IMAGE_AREA_KEY = "image_area"


@dataclass
class TrainedImageArea:
    """What the checkpoint's training data says: one area (None: the VQ dir's own bounds), or why not."""

    area: Optional[int] = None
    sources: list[str] = field(default_factory=list)  # the token-shard folders read
    problem: Optional[str] = None  # set when the area cannot be told (unreadable or disagreeing manifests)


def trained_image_area(ckpt_dir: str | os.PathLike) -> Optional[TrainedImageArea]:
    """The image area of the token shards the checkpoint's latest iteration was trained on; None
    for a checkpoint never trained by mmtrain (e.g. `hf-to-mcore` output: no trainer state)."""
    root = Path(ckpt_dir)
    latest = read_latest(root)
    state_file = iter_dir(root, latest) / TRAINER_STATE if latest is not None else None
    if state_file is None or not state_file.is_file():
        return None
    paths = (json.loads(state_file.read_text()).get("data") or {}).get("data.paths") or []
    if not paths:
        return None
    areas: dict[str, Optional[int]] = {}
    unread: list[str] = []
    for p in map(Path, paths):
        manifest = p / MANIFEST_NAME
        try:
            m = json.loads(manifest.read_text()) if p.is_dir() else None
        except (OSError, ValueError):
            m = None
        if isinstance(m, dict) and IMAGE_AREA_KEY in m:
            areas[str(p)] = m[IMAGE_AREA_KEY]
        else:
            unread.append(str(p))
    found = TrainedImageArea(sources=sorted(areas))
    if unread:
        found.problem = (
            f"the training data's token-shard manifests are not readable ({', '.join(unread)}): "
            f"its --image-area is unknown"
        )
    elif len(set(areas.values())) > 1:
        found.problem = (
            "the training data's token shards were made at different image areas ("
            + ", ".join(f"{p}: {a}" for p, a in sorted(areas.items()))
            + ")"
        )
    else:
        found.area = next(iter(areas.values()))
    return found


def with_image_area(processor_cfg: dict, area: int) -> dict:
    """`processor_cfg` (an Emu3ImageProcessor's) resizing every image to about `area` pixels."""
    return {**processor_cfg, "min_pixels": area, "max_pixels": area, "size": {"min_pixels": area, "max_pixels": area}}


def record_trained_image_area(ckpt_dir: str | os.PathLike, processor_file: Path) -> Optional[int]:
    """Rewrite the exported `processor_file` with the area the checkpoint was trained at (logged);
    a warning where the area cannot be told. Returns the area written, if any."""
    found = trained_image_area(ckpt_dir)
    if found is None or not processor_file.is_file():
        return None
    cfg = json.loads(processor_file.read_text())
    kept = cfg.get("max_pixels")
    if found.problem is not None:
        log.warning(
            "%s: %s; it keeps the VQ's max_pixels %s: set min_pixels/max_pixels to the area the "
            "token shards were made with (`mmdata tokenize-images --image-area`)",
            processor_file.name,
            found.problem,
            kept,
        )
        return None
    if found.area is None:  # tokenized at the VQ dir's own bounds: the copied config is right
        return None
    processor_file.write_text(json.dumps(with_image_area(cfg, int(found.area)), indent=2) + "\n")
    log.info(
        "%s: image area %d px (the token shards' --image-area, %s; the VQ's was %s)",
        processor_file.name,
        found.area,
        ", ".join(found.sources),
        kept,
    )
    return int(found.area)
