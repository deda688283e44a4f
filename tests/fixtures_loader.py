"""The LLaVA-OV loader tests' dev samples (shared by test_loader, test_vision_balance and
test_mixed_media_packs): random PNG/JPEG/MP4 bytes, a one-turn conversation, and 36 good samples
of every media kind mixed with the 5 bad ones the loader must skip (`BAD_IDS`). Also what the
loader checks share: the tiny tile geometry, the options of a plan loader that saves its state
after every sample, the batches before and after a saved state, and a balanced plan at the tiny
recipe's geometry."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import av  # the loader tests' clips; av is a product dependency (the video decoder)
import numpy as np
from PIL import Image

from mmdata.cli import main as mmdata_main
from mmdata.dev.shards import DevSample

BAD_IDS = {"bad-empty-image", "bad-truncated-png", "bad-video", "bad-role", "bad-placeholders"}
#: the tiny vision geometry (as the model tests use): 28 px tiles of 2x2 patches
TINY_TILES = {"image_size": 28, "patch_size": 14}
#: `build_llava_ov_loader` options: packs from the pack plan, its state checkpointed after every sample
PLAN_RESUMABLE = {"packing": "plan", "checkpoint_every_min_n_samples": 1, "checkpoint_every_sec": 0}


#: `mmdata pack-plan`'s geometry options of the tiny recipe (recipes/llava-ov-tiny.yaml: 30-px tiles)
TINY_RECIPE_PLAN_GEOMETRY = (
    ("--image-size", "30"), ("--patch-size", "14"), ("--max-tiles", "9"), ("--grid-max", "6"), ("--video-frames", "8"),
)  # fmt: skip


def pack_balanced_tiny_plan(shards: Path, seq_length: int, dp: int, micro_batch_size: int, global_batch: int) -> None:
    """`mmdata pack-plan` of `shards` at the tiny recipe's geometry, balanced for a step shape."""
    geometry = [x for pair in TINY_RECIPE_PLAN_GEOMETRY for x in pair]
    shape = ["--dp", str(dp), "--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(global_batch)]
    args = [
        "pack-plan",
        str(shards),
        "--seq-length",
        str(seq_length),
        *geometry,
        *shape,
        "--jobs",
        "1",
        "--no-progress",
    ]
    assert mmdata_main(args) == 0


def batches_around_saved_state(loader: Iterable, before: int, after: int) -> tuple[list, str, list]:
    """(the first `before` batches, the loader's state saved after them, the `after` batches that
    follow); the iterator is closed on return, so a restored loader is the only one reading."""
    it = iter(loader)
    first = [next(it) for _ in range(before)]
    state = loader.save_state_json()
    rest = [next(it) for _ in range(after)]
    return first, state, rest


def png_bytes(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def jpeg_bytes(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def mp4_bytes(frames: int = 10, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def qa(q: str, a: str) -> list[dict]:
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


def llava_dev_samples() -> list[DevSample]:
    sizes = [(20, 30), (90, 40), (28, 28), (12, 200), (150, 60), (33, 47)]
    out: list[DevSample] = []
    for i in range(36):
        kind = i % 6
        if kind in (0, 1, 2):
            h, w = sizes[i % len(sizes)]
            data = ("png", png_bytes(h, w, i)) if i % 2 else ("jpg", jpeg_bytes(h, w, i))
            out.append(DevSample(f"img-{i}", qa("<image>\nWhat is shown?", f"Answer number {i}."), [data]))
        elif kind == 3:
            out.append(DevSample(f"txt-{i}", qa("Tell me a fact.", f"Fact {i}: the sea is salty.") * 2))
        elif kind == 4:
            out.append(
                DevSample(
                    f"multi-{i}",
                    qa("<image><image> Compare them.", f"They differ {i}."),
                    [("png", png_bytes(20, 40, i)), ("png", png_bytes(50, 10, i + 1))],
                )
            )
        else:
            out.append(
                DevSample(f"vid-{i}", qa("What happens in the clip?", f"Noise {i}."), video=("mp4", mp4_bytes(10, i)))
            )
    good_png = png_bytes(30, 30, 99)
    out += [
        DevSample("bad-empty-image", qa("<image> x", "y"), [("jpg", b"")]),
        DevSample("bad-truncated-png", qa("<image> x", "y"), [("png", good_png[: len(good_png) // 2])]),
        DevSample("bad-video", qa("<video> x", "y"), video=("mp4", b"not a video at all" * 10)),
        DevSample("bad-role", [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]),
        DevSample("bad-placeholders", qa("<image><image> x", "y"), [("png", good_png)]),
    ]
    order = np.random.default_rng(0).permutation(len(out))
    return [out[i] for i in order]
