"""Video frames: decord decode with uniform sampling up to a frame limit (LLaVA-OV's default).

Split in two so packing can count tokens before decoding pixels: `probe_video` opens the
container (frame count only), `decode_frames` reads just the sampled frames.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from mmdata.media_layout.media import DEFAULT_MAX_FRAMES


@dataclass
class VideoProbe:
    total_frames: int
    frame_indices: list[int]


def uniform_frame_indices(total_frames: int, max_frames: int = DEFAULT_MAX_FRAMES) -> list[int]:
    """`min(total, max)` indices spread evenly over the clip, first and last included."""
    if total_frames < 1:
        raise ValueError("video has no frames")
    n = min(total_frames, max_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, n).round().astype(np.int64)]


def _reader(data: bytes):
    import decord  # lazy: optional heavy dependency (video samples only)

    return decord.VideoReader(io.BytesIO(data), num_threads=1)


def probe_video(data: bytes, max_frames: int = DEFAULT_MAX_FRAMES) -> VideoProbe:
    if not data:
        raise ValueError("empty video bytes")
    total = len(_reader(data))
    return VideoProbe(total, uniform_frame_indices(total, max_frames))


def decode_frames(data: bytes, frame_indices: list[int]) -> np.ndarray:
    """[T, H, W, 3] uint8 RGB frames at the given indices."""
    frames = _reader(data).get_batch(frame_indices).asnumpy()
    if frames.ndim != 4 or frames.shape[0] != len(frame_indices):
        raise ValueError(f"decord returned frames of shape {frames.shape} for {len(frame_indices)} indices")
    return frames
