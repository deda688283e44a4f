"""Write a small energon-ready shard set straight from in-memory samples.

For loader tests and benchmarks that need exact control over the content (bad bytes, videos,
text-only, known ids) without running the Ray preprocess job. Same on-disk contract as
`mmdata preprocess` (shard_format.py), written by its shard writer, and the same energon
preparation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mmdata import shard_format as sf
from mmdata.shard_job.energon_meta import write_energon_index, write_tar_index
from mmdata.shard_job.shard_writer import SampleMembers, write_shard


@dataclass
class DevSample:
    id: str
    conversations: list[dict]
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (ext, bytes)
    video: tuple[str, bytes] | None = None  # (ext, bytes)
    source: str = "dev"


def write_dev_shards(
    out_dir: str | Path, samples: Sequence[DevSample], samples_per_shard: int = 16, key_offset: int = 0
) -> Path:
    """Write `samples` as shards under `out_dir` and prepare `.nv-meta/`; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names, layouts = [], []
    for shard_i, start in enumerate(range(0, len(samples), samples_per_shard)):
        name = sf.SHARD_NAME_TEMPLATE.format(shard_i)
        shard_samples = []
        for j, s in enumerate(samples[start : start + samples_per_shard]):
            image_names = [sf.image_member_name(k, ext) for k, (ext, _) in enumerate(s.images)]
            video_name = sf.video_member_name(s.video[0]) if s.video else None
            record = sf.SampleRecord(
                id=s.id, source=s.source, conversations=s.conversations, images=image_names, video=video_name
            )
            members = [(sf.JSON_MEMBER, json.dumps(record.__dict__, ensure_ascii=False).encode())]
            members += [(n, data) for n, (_, data) in zip(image_names, s.images)]
            if s.video:
                members.append((video_name, s.video[1]))
            shard_samples.append(SampleMembers(f"{key_offset + start + j:010d}", members))
        _, layout = write_shard(out / name, shard_samples)
        write_tar_index(out / name, layout)
        names.append(name)
        layouts.append(layout)
    write_energon_index(out, names, layouts)
    return out
