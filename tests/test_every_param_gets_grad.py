"""Review A1: every trainable parameter gets a gradient on every micro-batch, for every family
and every stage's freeze set.

Why: megatron's DistributedDataParallel with `overlap_grad_reduce=True` (our setting on every
device) counts the gradients of each bucket's parameters: a parameter without one makes
`zero_grad_buffer` assert at the next step, or `finish_grad_sync` assert that the bucket's
communication was never issued. LLaVA-OV had two such cases: the unused SigLIP `ln_post`, and the
vision tower / projector / newline on a text-only micro-batch or a CP rank holding no media.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import yaml

from tests.llava_tiny import IMAGE_TOKEN, hf_image_inputs, hf_llava, images

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("megatron_cpu")]

REPO = Path(__file__).resolve().parents[1]


def stage_freezes(family: str, *recipe_names: str) -> dict[str, list[str]]:
    """{"recipe:stage": freeze list} for the recipe itself and each entry of its `stages:`, as
    the recipe loader resolves them."""
    from mmtrain.config.load import load_recipe

    out = {}
    for name in recipe_names:
        path = REPO / "recipes" / name
        raw = yaml.safe_load(path.read_text())
        out[f"{path.stem}:default"] = list(load_recipe(path, [], family).freeze)
        for stage in raw.get("stages") or {}:
            out[f"{path.stem}:{stage}"] = list(load_recipe(path, [f"stage={stage}"], family).freeze)
    return out


LLAVA_FREEZES = stage_freezes("llava-ov", "llava-ov-tiny.yaml", "aquila-vl-2b.yaml")
EMU3_FREEZES = stage_freezes("emu3", "emu3-tiny.yaml", "emu3-8b.yaml")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def llava_cfg():
    from mmtrain.llava_ov.state_dict_adapter import llava_config_from_hf

    return llava_config_from_hf(hf_llava(seed=0).config.to_dict())


def _llava(cfg, freeze: list[str]):
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.optimizer import ModelParts, apply_freeze

    torch.manual_seed(0)
    model = LlavaOVModel(cfg).train()
    apply_freeze([model], ModelParts([model], LLAVA_OV.parts), freeze)
    return model


def _with_labels(batch):
    from mmdata.energon_loaders.batch import IGNORE_INDEX

    ids = batch.input_ids
    batch.labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
    batch.labels[batch.labels == IMAGE_TOKEN] = IGNORE_INDEX
    return batch


def image_batch(cfg):
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    rows, pv, sizes = hf_image_inputs(images())
    return _with_labels(hf_inputs_to_batch(cfg, rows[0][None], pv[:1], sizes[:1]))


def text_batch(cfg, no_pixels: bool = False, seed: int = 1):
    """A text-only micro-batch: empty pixel_values as the loader gives, or None."""
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    ids = torch.randint(0, 990, (1, 24), generator=torch.Generator().manual_seed(seed))
    batch = _with_labels(hf_inputs_to_batch(cfg, ids))
    if no_pixels:
        batch.pixel_values = None
    return batch


def _loss(model, batch) -> torch.Tensor:
    from mmtrain.llava_ov.forward_step import forward_step

    out, loss_fn = forward_step(iter([batch]), model)
    loss_sum, n, _ = loss_fn(out)
    return loss_sum / n


def missing_grads(model) -> list[str]:
    """Trainable parameters without a gradient (param.grad, or megatron DDP's main_grad)."""
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None
    ]


# ----------------------------------------------------------------------------- LLaVA-OV


def test_llava_ln_post_is_frozen_but_kept_for_conversion(llava_cfg):
    """LLaVA-OV never applies SigLIP's post-layernorm: it is frozen (no gradient is ever due),
    still a parameter, so HF / LLaVA-NeXT round trips keep `post_layernorm.*`."""
    from mmtrain.llava_ov.state_dict_adapter import LlavaOVStateDictAdapter, normalize_llava_hf_key

    model = _llava(llava_cfg, [])
    names = dict(model.named_parameters())
    assert {"vision_model.ln_post.weight", "vision_model.ln_post.bias"} <= set(names)
    assert (
        not names["vision_model.ln_post.weight"].requires_grad and not names["vision_model.ln_post.bias"].requires_grad
    )
    # transformers' LlavaOnevision checkpoints hold the post-layernorm: the adapter still maps it
    # (the export round trips themselves: tests/test_convert.py, tests/test_llava_next_format.py)
    hf = {normalize_llava_hf_key(k) for k in hf_llava(seed=0).state_dict()}
    post = {k for k in hf if "post_layernorm" in k}
    assert post and {"vision_model.ln_post.weight", "vision_model.ln_post.bias"} <= set(model.state_dict())
    LlavaOVStateDictAdapter(llava_cfg).check_hf_keys(hf)


@pytest.mark.parametrize("stage", sorted(LLAVA_FREEZES))
@pytest.mark.parametrize("kind", ["images", "text_only", "no_pixel_values"])
def test_llava_every_trainable_param_gets_a_grad(llava_cfg, stage, kind):
    """For each stage's freeze set and each kind of micro-batch; the loss is the one computed
    without the zero-contribution terms (they only run when a backward follows)."""
    model = _llava(llava_cfg, LLAVA_FREEZES[stage])
    make = {"images": image_batch, "text_only": text_batch, "no_pixel_values": lambda c: text_batch(c, no_pixels=True)}[
        kind
    ]
    with torch.no_grad():
        reference = _loss(model, make(llava_cfg))
    loss = _loss(model, make(llava_cfg))
    assert torch.equal(loss.detach(), reference)
    if not any(p.requires_grad for p in model.parameters()):
        return
    loss.backward()
    assert missing_grads(model) == []


def _cp_rank_without_media(cfg):
    """A one-image sample whose media positions all fall in the first quarter of the stream:
    under CP=2's load-balanced split (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2) rank 1
    holds none of them. Returns (batch, rank 1's layout)."""
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.models.context_parallel import cp_layout

    rows, pv, sizes = hf_image_inputs(images()[2:], text_len=2)
    head = rows[0]
    tail = torch.randint(0, 990, (4 * head.numel(),), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([head, tail])[None]
    batch = _with_labels(hf_inputs_to_batch(cfg, ids, pv, sizes))
    layout = cp_layout(batch.cu_seqlens, 2, 1, 4)
    is_media = ids.reshape(-1) == IMAGE_TOKEN
    held = torch.cat([is_media, torch.zeros(1, dtype=torch.bool)])[layout.index]
    assert is_media.any() and not held.any()  # the case under test
    return batch, layout


@pytest.mark.parametrize("stage", sorted(LLAVA_FREEZES))
def test_llava_cp_rank_without_media_still_reaches_the_encoders(llava_cfg, stage):
    """The CP rank's decoder input (what the vision tower, projector and newline feed) gives each
    of their trainable parameters a gradient, and its values are unchanged."""
    model = _llava(llava_cfg, LLAVA_FREEZES[stage])
    batch, layout = _cp_rank_without_media(llava_cfg)
    with torch.no_grad():
        reference = model._decoder_input(batch, layout)
    emb = model._decoder_input(batch, layout)
    assert torch.equal(emb.detach(), reference)
    if not emb.requires_grad:
        return
    emb.float().square().sum().backward()
    encoders = [n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("language_model.")]
    missing = set(missing_grads(model))
    assert not missing & set(encoders), sorted(missing & set(encoders))


# ----------------------------------------------------------------------------- Emu3


def _emu3(freeze: list[str]):
    from mmtrain.config.load import load_recipe
    from mmtrain.emu3.spec import EMU3, build_model
    from mmtrain.runtime.optimizer import ModelParts, apply_freeze

    torch.manual_seed(0)
    model = build_model(load_recipe(REPO / "recipes" / "emu3-tiny.yaml", [], "emu3").model).train()
    apply_freeze([model], ModelParts([model], EMU3.parts), freeze)
    return model


def _emu3_batch(vocab: int):
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.emu3.batch import Emu3Batch

    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(2))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    return Emu3Batch(
        input_ids=ids,
        labels=labels,
        position_ids=torch.arange(24)[None],
        cu_seqlens=torch.tensor([0, 24], dtype=torch.int32),
        max_seqlen=24,
        num_loss_tokens=23,
    )


@pytest.mark.parametrize("stage", sorted(EMU3_FREEZES))
def test_emu3_every_trainable_param_gets_a_grad(stage):
    """Emu3 has no encoder (images are VQ tokens in input_ids): the decoder alone, so every
    micro-batch reaches every parameter. A guard, not a fix: this passes before and after A1."""
    from mmtrain.emu3.spec import EMU3

    model = _emu3(EMU3_FREEZES[stage])
    out, loss_fn = EMU3.forward_step(iter([_emu3_batch(1000)]), model)
    loss_sum, n, _ = loss_fn(out)
    if not any(p.requires_grad for p in model.parameters()):
        return
    (loss_sum / n).backward()
    assert missing_grads(model) == []


# ----------------------------------------------------------------------------- megatron DDP


def test_llava_trains_under_megatron_ddp_with_overlapped_grad_reduce(llava_cfg):
    """megatron's real DistributedDataParallel, overlap_grad_reduce=True, world of one (gloo):
    2 steps of 2 micro-batches, the last one text-only. Before the fix, step 1's finish_grad_sync
    asserts that the vision bucket's communication was never issued, or step 2's zero_grad_buffer
    that a parameter (`ln_post`) got no gradient."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _llava(llava_cfg, [])
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=False, check_for_nan_in_grad=False
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    assert ddp.ddp_config.overlap_grad_reduce
    for step in range(2):
        ddp.zero_grad_buffer()
        micro = [image_batch(llava_cfg), text_batch(llava_cfg, seed=10 + step)]
        for i, batch in enumerate(micro):
            with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                _loss(ddp, batch).backward()
        ddp.finish_grad_sync()
        assert missing_grads(model) == []
        assert all(torch.isfinite(p.main_grad).all() for p in model.parameters() if p.requires_grad)
