"""Parity of our anyres tiling and token counts with transformers' LLaVA-OneVision (the oracle).

The HF image processor is the PIL backend (torchvision is not installed, and the PIL backend
is what `LlavaOnevisionImageProcessor` resolves to here), configured as the released
llava-onevision checkpoints are (SigLIP mean = std = 0.5).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.modeling_llava_onevision import unpad_image

from mmdata.energon_loaders.llava_ov import anyres
from tests.llava_tiny import ImagesOnlyProcessor, hf_image_processor

# `unit` test by test: the HF sweep is slow and the warnings check starts a subprocess

torch.set_num_threads(1)

# (height, width): tiny, square, extreme aspect ratios, odd sizes, > 2304 px
FAST_SIZES = [
    (1, 1),
    (20, 20),
    (32, 2000),
    (2000, 32),
    (384, 384),
    (385, 383),
    (480, 640),
    (700, 100),
    (1080, 1920),
    (2600, 2400),
]
SLOW_SIZES = FAST_SIZES + [
    (10, 3000),
    (3000, 10),
    (383, 385),
    (767, 769),
    (1152, 1153),
    (2304, 2304),
    (4000, 300),
    (123, 4567),
    (999, 1001),
    (2305, 1),
]


@pytest.fixture(scope="module")
def hf_processor(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return ImagesOnlyProcessor(
        image_processor=hf_image_processor(),
        tokenizer=tok,
        video_processor=None,
        num_image_tokens=729,
        vision_feature_select_strategy="full",
    )


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok"))


def _random_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + h * 7919 + w)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _count_expanded(processor, images, text: str) -> int:
    out = processor(images=images, text=[text], return_tensors="pt")
    return int((out["input_ids"] == processor.image_token_id).sum())


@pytest.mark.unit
def test_grid_pinpoints_match_hf_default():
    assert [list(p) for p in anyres.grid_pinpoints()] == LlavaOnevisionImageProcessorPil.image_grid_pinpoints


@pytest.mark.unit
def test_known_token_counts():
    # worked values from the reference notes
    assert anyres.num_image_tokens(384, 384) == 1485
    assert anyres.num_image_tokens(480, 640) == 2929
    assert anyres.num_image_tokens(1080, 1920) == 7269
    assert anyres.num_image_tokens(2304, 2304) == 7371
    assert anyres.num_base_only_tokens() == 730
    assert anyres.num_video_tokens(8) == 8 * 196 + 1


@pytest.mark.unit
@pytest.mark.parametrize("size", FAST_SIZES)
def test_pixels_and_tokens_match_hf(size, hf_processor):
    h, w = size
    image = _random_image(h, w)
    ref = hf_processor.image_processor(image, return_tensors="pt")["pixel_values"][0]
    ours = anyres.process_image(image)
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == ref.shape
    assert (ours.pixel_values - ref).abs().max().item() <= 1e-5
    assert ours.image_size == (h, w)
    assert ours.pixel_values.shape[0] == 1 + ours.grid_shape[0] * ours.grid_shape[1]
    assert ours.num_tokens == _count_expanded(hf_processor, [image], "<|im_start|>user\n<image>\nhi<|im_end|>\n")
    assert ours.num_tokens == anyres.num_image_tokens(h, w)


@pytest.mark.slow
@pytest.mark.parametrize("size", SLOW_SIZES)
def test_pixels_match_hf_sweep(size, hf_processor):
    h, w = size
    image = _random_image(h, w, seed=1)
    ref = hf_processor.image_processor(image, return_tensors="pt")["pixel_values"][0]
    ours = anyres.process_image(image)
    assert (ours.pixel_values - ref).abs().max().item() <= 1e-5
    assert ours.num_tokens == _count_expanded(hf_processor, [image], "<image> describe")


@pytest.mark.unit
def test_token_count_sweep_matches_hf_counter(hf_processor):
    """Wide sweep of sizes through HF's own counting routine (the one `__call__` uses)."""
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, size=(300, 2))]
    sizes += [(h, w) for h in (1, 2, 383, 384, 385, 768, 2304, 2305) for w in (1, 3, 384, 1000, 2304, 9000)]
    hf = hf_processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [anyres.num_image_tokens(h, w) for h, w in sizes] == hf


@pytest.mark.unit
def test_multi_image_and_rgba_match_hf(hf_processor):
    images = [_random_image(300, 500), _random_image(90, 40), _random_image(64, 64)]
    rgba = Image.fromarray(np.random.default_rng(3).integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA")
    images.append(rgba)
    ref = hf_processor.image_processor([images], return_tensors="pt")["pixel_values"]
    for i, image in enumerate(images):
        ours = anyres.process_base_only(image)
        assert ours.pixel_values.shape == (1, 3, 384, 384)
        assert (ours.pixel_values[0] - ref[i][0]).abs().max().item() <= 1e-5
    n = _count_expanded(hf_processor, [images], "<image><image><image><image> compare")
    assert n == sum(anyres.process_base_only(im).num_tokens for im in images) == 4 * 730
    # the RGBA image alone goes through anyres with white compositing, as HF does
    single = hf_processor.image_processor(rgba, return_tensors="pt")["pixel_values"][0]
    assert (anyres.process_image(rgba).pixel_values - single).abs().max().item() <= 1e-5


@pytest.mark.unit
def test_video_token_count_matches_hf(hf_processor):
    for frames in (1, 4, 8, 32):
        hf = hf_processor._get_num_multimodal_tokens(video_sizes=[(frames, 100, 100)])["num_video_tokens"][0]
        assert anyres.num_video_tokens(frames) == hf
    clip = np.random.default_rng(0).integers(0, 256, (3, 40, 60, 3), dtype=np.uint8)
    out = anyres.process_frames(clip)
    assert out.pixel_values.shape == (3, 3, 384, 384) and out.num_tokens == 3 * 196 + 1
    ref = np.asarray(Image.fromarray(clip[1]).resize((384, 384), Image.Resampling.BICUBIC), dtype=np.float32)
    ref = torch.from_numpy(ref).permute(2, 0, 1) / 255.0 * 2 - 1
    assert (out.pixel_values[1] - ref).abs().max().item() <= 1e-5


@pytest.mark.unit
@pytest.mark.parametrize("image_size,patch_size", [(28, 14), (56, 14), (32, 8)])
def test_tiny_vision_configs_match_hf(image_size, patch_size, tiny_tokenizer_dir):
    """Tiny SigLIP configs used by the model tests: same rules, scaled."""
    from transformers import AutoTokenizer

    pps = image_size // patch_size
    proc = ImagesOnlyProcessor(
        image_processor=hf_image_processor(image_size),
        tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir),
        video_processor=None,
        num_image_tokens=pps * pps,
        vision_feature_select_strategy="full",
    )
    for h, w in [(5, 5), (30, 100), (100, 30), (image_size * 6 + 1, image_size * 2), (17, 400)]:
        image = _random_image(h, w)
        ours = anyres.process_image(image, image_size=image_size, patch_size=patch_size)
        ref = proc.image_processor(image, return_tensors="pt")["pixel_values"][0]
        assert (ours.pixel_values - ref).abs().max().item() <= 1e-5
        assert ours.num_tokens == _count_expanded(proc, [image], "<image> hi")
    assert (
        anyres.num_video_tokens(2, image_size, patch_size)
        == (proc._get_num_multimodal_tokens(video_sizes=[(2, 10, 10)])["num_video_tokens"][0])
    )


@pytest.mark.unit
@pytest.mark.parametrize("size", [(20, 20), (32, 2000), (480, 640), (1080, 1920), (2600, 2400), (700, 100)])
def test_feature_shape_matches_hf_model_unpad(size):
    """The model-side shape arithmetic equals HF's unpad_image + anyres_max interpolate."""
    h, w = size
    rows, cols = anyres.anyres_grid_shape(h, w)
    feat = torch.zeros(1, 27 * rows, 27 * cols)
    unpadded = unpad_image(feat, [h, w])
    ch, cw = unpadded.shape[1:]
    ratio = math.sqrt(ch * cw / (9 * 27**2))
    if ratio > 1.1:
        unpadded = torch.nn.functional.interpolate(
            unpadded[None], [int(ch // ratio), int(cw // ratio)], mode="bilinear"
        )[0]
    assert anyres.unpadded_feature_shape(h, w, rows, cols, 27, 9) == tuple(unpadded.shape[1:])


@pytest.mark.unit
def test_grid_shape_matches_hf_best_resolution_on_every_side_class():
    """anyres_grid_shape's direct covering-grid answer equals HF's `select_best_resolution` loop:
    every side length around each tile boundary (k*S - 1, k*S, k*S + 1) crossed with every other,
    past the largest pinpoint too, and random sizes, for two geometries."""
    from transformers.image_processing_utils import select_best_resolution as hf_best

    rng = np.random.default_rng(0)
    for image_size, grid_max in ((384, 6), (28, 3)):
        pinpoints = [list(p) for p in anyres.grid_pinpoints(image_size, grid_max)]
        sides = sorted({max(1, k * image_size + d) for k in range(grid_max + 2) for d in (-1, 0, 1)} | {1, 2})
        sizes = [(h, w) for h in sides for w in sides]
        sizes += [tuple(int(x) for x in rng.integers(1, (grid_max + 1) * image_size, 2)) for _ in range(300)]
        for h, w in sizes:
            best_h, best_w = hf_best((h, w), pinpoints)
            assert anyres.anyres_grid_shape(h, w, image_size, grid_max) == (
                best_h // image_size,
                best_w // image_size,
            ), (h, w)


@pytest.mark.unit
def test_max_tiles_changes_only_the_shrink():
    image = _random_image(1080, 1920)
    a, b = anyres.process_image(image, max_tiles=9), anyres.process_image(image, max_tiles=4)
    assert torch.equal(a.pixel_values, b.pixel_values)
    assert b.num_tokens < a.num_tokens


_HWC_QUIET = """
import warnings
from PIL import Image
from mmdata.energon_loaders.llava_ov import anyres

warnings.simplefilter("error")  # any warning from here on fails the program
for size in ((3, 2), (64, 48)):
    anyres._hwc(Image.new("RGB", size))

# A filter another thread adds while an image is wrapped must survive the call.
real = anyres.torch.from_numpy
def from_numpy_while_another_thread_adds_a_filter(array):
    warnings.filterwarnings("ignore", message="added meanwhile")
    return real(array)
anyres.torch.from_numpy = from_numpy_while_another_thread_adds_a_filter
anyres._hwc(Image.new("RGB", (5, 5)))
anyres.torch.from_numpy = real
assert any(f[1] is not None and f[1].pattern == "added meanwhile" for f in warnings.filters), "a filter was dropped"
"""


def test_hwc_neither_warns_nor_touches_the_warning_filters():
    """torch's one-time "non-writable NumPy array" warning is spent at import, so wrapping an
    image's pixels warns nothing and never saves/restores the process's filters (a
    `catch_warnings()` per image would drop filters that other threads add meanwhile)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _HWC_QUIET], check=True)
