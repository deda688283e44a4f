"""C4 (gpu-path-review): how a batch reaches the device. Pinned by torch's DataLoader pin thread,
copied asynchronously, metadata kept on the host (no device-to-host reads in the forward),
uint8 pixels normalised on the device bit-equal to the former fp32 loader normalisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

pytestmark = pytest.mark.unit

METADATA = ("tiles_per_media", "media_kind", "image_sizes", "grid_shapes", "num_media_tokens")


def _llava_batch(pixels: torch.Tensor | None = None):
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, LlavaOVBatch

    ids = torch.arange(12)[None]
    return LlavaOVBatch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=ids.clone(),
        cu_seqlens=torch.tensor([0, 7, 12], dtype=torch.int32),
        max_seqlen=7,
        sample_ids=[["a", "b"]],
        pixel_values=torch.zeros(2, 3, 4, 4, dtype=torch.uint8) if pixels is None else pixels,
        tiles_per_media=torch.tensor([2]),
        media_kind=torch.tensor([MEDIA_ANYRES]),
        image_sizes=torch.tensor([[4, 8]]),
        grid_shapes=torch.tensor([[1, 1]]),
        num_media_tokens=torch.tensor([3]),
    )


def _emu3_batch():
    from mmdata.energon_loaders.emu3.batch import Emu3Batch

    ids = torch.arange(6)[None]
    return Emu3Batch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=ids.clone(),
        cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
        max_seqlen=6,
        tasks=[["generation"]],
    )


@pytest.mark.parametrize("make", [_llava_batch, _emu3_batch])
def test_torch_pin_thread_pins_every_tensor_of_the_batch(make, monkeypatch):
    """torch's pin logic (what energon's pin_memory=True DataLoader runs) calls the batch's
    `pin_memory()`; a plain dataclass would come back unpinned."""
    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin

    batch = make()
    pinned: list[int] = []

    def fake_pin(t, *a, **k):  # a CPU-only build cannot pin: record and hand back a marked copy
        pinned.append(t.data_ptr())
        out = t.clone()
        out._c4_pinned = True
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = torch_pin(batch)
    assert type(out) is type(batch)
    tensors = {f: v for f, v in vars(out).items() if isinstance(v, torch.Tensor)}
    assert tensors and all(getattr(v, "_c4_pinned", False) for v in tensors.values()), tensors.keys()
    assert len(pinned) == len(tensors)
    assert out.sample_ids == batch.sample_ids and torch.equal(out.input_ids, batch.input_ids)


def test_to_moves_inputs_async_and_keeps_metadata_on_host(monkeypatch):
    batch = _llava_batch()
    calls: list[bool] = []
    real_to = torch.Tensor.to

    def spy_to(t, *a, **k):
        calls.append(bool(k.get("non_blocking", False)))
        return real_to(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: t.device.type == "cpu")  # as after pin_memory()
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    moved = batch.to("meta")
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert calls and all(calls)  # every copy from pinned memory is non_blocking
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values"):
        assert getattr(moved, name).device.type == "meta", name
    for name in METADATA:
        assert getattr(moved, name).device.type == "cpu", name
    assert torch.equal(moved.host_cu_seqlens(), batch.cu_seqlens)
    assert torch.equal(moved.host_input_ids(), batch.input_ids)
    assert moved.pixel_values.dtype == torch.uint8  # 1 byte per channel crosses the bus


def test_later_pipeline_stages_leave_pixels_on_the_host(monkeypatch):
    """`packed_forward_step` on a chunk without `pre_process` (behind megatron's wrappers) moves
    no pixels; the first stage moves them."""
    import mmtrain.runtime.distributed as distributed
    from mmtrain.runtime.loss import packed_forward_step

    monkeypatch.setattr(distributed, "compute_device", lambda: torch.device("meta"))
    seen = []

    class Stage(torch.nn.Module):
        def __init__(self, first: bool):
            super().__init__()
            self.pre_process = first

        def forward(self, batch):
            seen.append(batch.pixel_values.device.type)
            return torch.zeros(batch.labels.shape, device=batch.labels.device)

    class Wrapper(torch.nn.Module):  # megatron's DDP / Float16Module keep the chunk as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, batch):
            return self.module(batch)

    for first in (False, True):
        packed_forward_step(iter([_llava_batch()]), Wrapper(Wrapper(Stage(first))))
    assert seen == ["cpu", "meta"]


def _tiny_llava_inputs():
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, LlavaOVBatch
    from tests.llava_tiny import IMAGE_SIZE, IMAGE_TOKEN, PATCH, images

    preps = [anyres.prepare_image(im, 9, image_size=IMAGE_SIZE, patch_size=PATCH) for im in images()[:2]]
    rows, lens = [], []
    for p in preps:
        rows.append(torch.cat([torch.arange(3) + 5, torch.full((p.num_tokens,), IMAGE_TOKEN), torch.arange(2) + 7]))
        lens.append(len(rows[-1]))
    ids = torch.cat(rows)[None]
    return LlavaOVBatch(
        input_ids=ids,
        labels=torch.where(ids == IMAGE_TOKEN, IGNORE_INDEX, ids),
        position_ids=torch.cat([torch.arange(n) for n in lens])[None],
        cu_seqlens=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        max_seqlen=max(lens),
        pixel_values=anyres.tiles_to_uint8(preps, IMAGE_SIZE),
        tiles_per_media=torch.tensor([p.num_tiles for p in preps]),
        media_kind=torch.tensor([MEDIA_ANYRES] * 2),
        image_sizes=torch.tensor([list(p.image_size) for p in preps]),
        grid_shapes=torch.tensor([list(p.grid_shape) for p in preps]),
        num_media_tokens=torch.tensor([p.num_tokens for p in preps]),
        sample_ids=[["a", "b"]],
    )


@pytest.mark.usefixtures("megatron_cpu")
def test_llava_forward_reads_nothing_back_from_the_device():
    """The model and its batch on the `meta` device: any `.tolist()` / `int()` / `.cpu()` of a
    device tensor raises there ("Cannot copy out of meta tensor"), so the forward passes only
    if every host read goes to host metadata. RoPE included: megatron's own unfused THD RoPE
    reads cu_seqlens back (`rope_utils._apply_rotary_pos_emb_thd`, `.tolist()`); the layer spec's
    `PackedRoPESelfAttention` (models/packed_rope.py, review N6) does not, so nothing is stubbed."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.state_dict_adapter import llava_config_from_hf
    from mmtrain.runtime.loss import loss_mask, per_sample_loss_sums
    from tests.llava_tiny import hf_llava

    cfg = llava_config_from_hf(hf_llava(seed=0).config.to_dict())
    batch = _tiny_llava_inputs()
    model = LlavaOVModel(cfg).eval()
    with torch.no_grad():
        ref = model(batch.to("cpu"))
    model = LlavaOVModel(cfg).eval().to("meta")  # a fresh one: the CPU run filled megatron's RoPE caches
    for rope in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):
        rope.inv_freq = rope.inv_freq.to("meta")  # a plain attribute: made on the run's device, not moved
    on_device = batch.to("meta")
    with torch.no_grad():
        out = model(on_device)
    assert out.device.type == "meta" and out.shape == ref.shape
    mask = loss_mask(on_device)
    assert per_sample_loss_sums(out, mask, on_device).shape == (2, 2)


def _old_fp32_pixels(media, image_size, mean, std) -> torch.Tensor:
    """The loader's normalisation at d23ed41 (anyres.tiles_to_pixel_values + _normalise_): the
    tiles cut as then (the same strided copy as `write_tiles` now, into float32), then scaled."""
    out = torch.empty((sum(m.num_tiles for m in media), 3, image_size, image_size), dtype=torch.float32)
    i = 0
    for m in media:
        m.write_tiles(out[i : i + m.num_tiles])
        i += m.num_tiles
    if len(set(mean)) == 1 and len(set(std)) == 1:
        return out.mul_(1.0 / (255.0 * std[0])).add_(-mean[0] / std[0])
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, 3, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, 3, 1, 1)
    return out.mul_(scale).add_(shift)


CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.mark.parametrize("mean,std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), (CLIP_MEAN, CLIP_STD)])
def test_uint8_tiles_normalised_bit_equal_to_the_old_fp32_path(mean, std):
    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, _batch_tensor

    rng = np.random.default_rng(3)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(47, 95), (120, 61), (64, 64)]]
    geo = dict(image_size=28, patch_size=14)
    media = [
        anyres.prepare_image(ims[0], 9, **geo),
        anyres.prepare_base_only(ims[1], mean=mean, **geo),
        anyres.prepare_image(ims[2], 4, **geo),
        anyres.prepare_frames(rng.integers(0, 256, (3, 20, 33, 3), dtype=np.uint8), **geo),
    ]
    shape = (sum(m.num_tiles for m in media), 3, 28, 28)
    assert _batch_tensor(shape).dtype == torch.uint8 and LlavaOVEncoderConfig is not None
    shipped = anyres.tiles_to_uint8(media, 28)
    assert shipped.dtype == torch.uint8
    new = anyres.normalise_pixels(shipped.to("meta"), mean, std)  # runs on whatever device holds it
    assert new.device.type == "meta" and new.dtype == torch.float32
    new = anyres.normalise_pixels(shipped, mean, std)
    assert torch.equal(new, _old_fp32_pixels(media, 28, mean, std))
    # and the single-image API (compared with HF's image processor in test_anyres) is this same path
    assert torch.equal(
        anyres.process_image(ims[0], 9, mean=mean, std=std, **geo).pixel_values, new[: media[0].num_tiles]
    )
