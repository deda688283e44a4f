"""LLaVA-OV on megatron-core vs transformers' LlavaOnevisionForConditionalGeneration (tiny random
configs): logits parity for anyres / multi-image / video inputs, packed sequences, the loss."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from tests.llava_tiny import IMAGE_SIZE, IMAGE_TOKEN, PATCH, VIDEO_TOKEN, hf_image_inputs, hf_llava, images  # noqa: E402

# the module's tests share one model built in-process: megatron's CPU adaptations for each test
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("megatron_cpu")]
TOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.state_dict_adapter import (
        LlavaOVStateDictAdapter,
        llava_config_from_hf,
        normalize_llava_hf_key,
    )
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    hf = hf_llava(seed=0)
    cfg = llava_config_from_hf(hf.config.to_dict())
    sd = {normalize_llava_hf_key(k): v for k, v in hf.state_dict().items()}
    adapter = LlavaOVStateDictAdapter(cfg)
    adapter.check_hf_keys(set(sd))
    model = LlavaOVModel(cfg).eval()
    load_canonical(model, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
    return hf, model, cfg


def _ours(model, cfg, **kw):
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    with torch.no_grad():
        return model(hf_inputs_to_batch(cfg, **kw), return_logits=True)


def test_anyres_images_logits_match_hf(pair):
    hf, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    for i in range(len(rows)):
        ids = rows[i][None]
        with torch.no_grad():
            ref = hf(input_ids=ids, pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1]).logits
        out = _ours(model, cfg, input_ids=ids, pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1])
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= TOL
    # the image really matters (the test can fail): other pixels, other logits
    out2 = _ours(model, cfg, input_ids=rows[0][None], pixel_values=pv[:1] * 0.3, image_sizes=sizes[:1])
    out1 = _ours(model, cfg, input_ids=rows[0][None], pixel_values=pv[:1], image_sizes=sizes[:1])
    assert (out2 - out1).abs().max().item() > 1e-3


def test_batched_rows_with_right_padding_match_hf(pair):
    hf, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    s = max(len(r) for r in rows[:2])
    ids = torch.zeros(2, s, dtype=torch.long)
    mask = torch.zeros(2, s, dtype=torch.long)
    for i in range(2):
        ids[i, : len(rows[i])] = rows[i]
        mask[i, : len(rows[i])] = 1
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pv[:2], image_sizes=sizes[:2]).logits
    out = _ours(model, cfg, input_ids=ids, attention_mask=mask, pixel_values=pv[:2], image_sizes=sizes[:2])
    valid = mask.bool()
    assert (out[valid] - ref[valid]).abs().max().item() <= TOL


def test_multi_image_and_video_logits_match_hf(pair):
    from mmdata.energon_loaders.llava_ov import anyres

    hf, model, cfg = pair
    imgs = images(1)[:2]
    tiles = [anyres.process_base_only(im, image_size=IMAGE_SIZE, patch_size=PATCH) for im in imgs]
    n_img = anyres.num_base_only_tokens(IMAGE_SIZE, PATCH)
    ids = torch.cat(
        [
            torch.tensor([5, 6]),
            torch.full((n_img,), IMAGE_TOKEN),
            torch.tensor([7]),
            torch.full((n_img,), IMAGE_TOKEN),
            torch.tensor([8, 9]),
        ]
    )[None]
    pv = torch.stack([t.pixel_values for t in tiles])  # [2, 1, 3, H, W]
    sizes = torch.tensor([list(t.image_size) for t in tiles])
    bni = torch.tensor([2])
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv, image_sizes=sizes, batch_num_images=bni).logits
    out = _ours(model, cfg, input_ids=ids, pixel_values=pv, image_sizes=sizes, batch_num_images=bni)
    assert (out - ref).abs().max().item() <= TOL

    frames = torch.randn(1, 3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3))
    n_vid = anyres.num_video_tokens(3, IMAGE_SIZE, PATCH)
    ids = torch.cat([torch.tensor([11, 12]), torch.full((n_vid,), VIDEO_TOKEN), torch.tensor([13, 14])])[None]
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values_videos=frames).logits
    out = _ours(model, cfg, input_ids=ids, pixel_values_videos=frames)
    assert (out - ref).abs().max().item() <= TOL


def _packed_batch(cfg, samples):
    """Pack single-image HF-style samples (ids, tiles, size) into one row + padding."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, LlavaOVBatch

    pad = 5
    ids = torch.cat([s[0] for s in samples] + [torch.zeros(pad, dtype=torch.long)])[None]
    lens = [len(s[0]) for s in samples] + [pad]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    grids = [anyres.anyres_grid_shape(*s[2], IMAGE_SIZE, 6) for s in samples]
    return LlavaOVBatch(
        input_ids=ids,
        labels=torch.full_like(ids, IGNORE_INDEX),
        position_ids=pos,
        cu_seqlens=torch.tensor([0] + lens).cumsum(0).to(torch.int32),
        max_seqlen=max(lens),
        pixel_values=torch.cat([s[1] for s in samples]),
        tiles_per_media=torch.tensor([s[1].shape[0] for s in samples]),
        media_kind=torch.tensor([MEDIA_ANYRES] * len(samples)),
        image_sizes=torch.tensor([list(s[2]) for s in samples]),
        grid_shapes=torch.tensor([list(g) for g in grids]),
        num_media_tokens=torch.tensor([int((s[0] == IMAGE_TOKEN).sum()) for s in samples]),
    ), lens


def test_packed_samples_equal_each_alone(pair):
    from mmdata.energon_loaders.llava_ov import anyres

    _, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    samples = []
    for i in (0, 1):
        n = anyres.process_image(images()[i], 9, image_size=IMAGE_SIZE, patch_size=PATCH).num_tiles
        samples.append((rows[i], pv[i, :n], tuple(sizes[i].tolist())))
    batch, lens = _packed_batch(cfg, samples)
    with torch.no_grad():
        packed = model(batch, return_logits=True)[0]
    start = 0
    for i, s in enumerate(samples):
        alone = _ours(model, cfg, input_ids=s[0][None], pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1])[0]
        assert (packed[start : start + lens[i]] - alone).abs().max().item() <= 1e-5
        start += lens[i]
    # without the segment boundary the second sample would see the first: logits differ
    batch.cu_seqlens = torch.tensor([0, lens[0] + lens[1], sum(lens)], dtype=torch.int32)
    batch.max_seqlen = lens[0] + lens[1]
    with torch.no_grad():
        leaky = model(batch, return_logits=True)[0]
    assert (leaky[lens[0] : lens[0] + lens[1]] - packed[lens[0] : lens[0] + lens[1]]).abs().max().item() > 1e-3


def test_forward_step_loss_matches_hf_loss(pair):
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    hf, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[0][None]
    hf_labels = ids.clone()
    hf_labels[ids == IMAGE_TOKEN] = IGNORE_INDEX
    hf_labels[0, :3] = IGNORE_INDEX
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv[:1], image_sizes=sizes[:1], labels=hf_labels).loss
    batch = hf_inputs_to_batch(cfg, ids, pv[:1], sizes[:1])
    batch.labels = torch.cat([hf_labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    with torch.no_grad():
        out, loss_fn = forward_step(iter([batch]), model)
    loss_sum, n, report = loss_fn(out)
    assert int(n) == int((batch.labels != IGNORE_INDEX).sum())
    assert abs(loss_sum.item() / int(n) - ref.item()) <= 1e-5
    assert torch.allclose(report["lm loss"], torch.tensor([loss_sum.item(), float(n)]))


def test_layout_token_counts_follow_loader_arithmetic(pair):
    """Every image size: features produced == anyres.num_image_tokens (the loader's count)."""
    from mmdata.energon_loaders.llava_ov import anyres
    from mmtrain.llava_ov.layout import anyres_features

    _, _, cfg = pair
    d = 8
    newline = torch.zeros(d)
    for h, w in [(30, 30), (31, 200), (200, 31), (47, 95), (180, 180), (100, 1000), (1000, 90), (61, 120)]:
        rows, cols = anyres.anyres_grid_shape(h, w, IMAGE_SIZE, 6)
        tiles = torch.randn(1 + rows * cols, cfg.vision.num_patches, d)
        feats = anyres_features(tiles, h, w, newline, cfg)
        assert feats.shape[0] == anyres.num_image_tokens(h, w, image_size=IMAGE_SIZE, patch_size=PATCH), (h, w)


def test_media_count_mismatch_is_an_error(pair):
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    _, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[0][None][:, :-10]
    ids = torch.cat([ids[:, :8], ids[:, 9:]], dim=1)  # one placeholder fewer
    with pytest.raises(ValueError, match="placeholder"):
        hf_inputs_to_batch(cfg, ids, pv[:1], sizes[:1])


def test_backward_reaches_every_part_and_freeze_stops_it(pair):
    """A training step's gradients reach vision, projector, newline and LLM; stage-1 freezing
    as training applies it (vision + LLM frozen) leaves only the projector trainable."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.optimizer import ModelParts, apply_freeze

    _, model, cfg = pair

    def fresh():  # megatron modules hold process groups: no deepcopy
        m = LlavaOVModel(cfg)
        m.load_state_dict(model.state_dict())
        return m.train()

    m = fresh()
    rows, pv, sizes = hf_image_inputs(images())
    batch = hf_inputs_to_batch(cfg, rows[0][None], pv[:1], sizes[:1])
    batch.labels = torch.cat([rows[0][None][:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    batch.labels[batch.labels == IMAGE_TOKEN] = IGNORE_INDEX
    out, loss_fn = forward_step(iter([batch]), m)
    loss_sum, n, _ = loss_fn(out)
    (loss_sum / n).backward()
    for name in (
        "vision_model.conv1.weight",
        "vision_model.decoder.layers.0.self_attention.linear_qkv.weight",
        "vision_projection.encoder.linear_fc1.weight",
        "image_newline",
        "language_model.embedding.word_embeddings.weight",
        "language_model.decoder.layers.1.mlp.linear_fc1.weight",
    ):
        g = dict(m.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name
    m2 = fresh()
    apply_freeze([m2], ModelParts([m2], LLAVA_OV.parts), ["vision_tower", "llm"])
    trainable = {n for n, p in m2.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in m2.named_parameters() if n.startswith("vision_projection.")}


def test_flops_per_token_for_aquila_size():
    """~6 x 1.54B decoder + LM-head params (the tied logits matmul counts) + causal attention
    at 12288: the cost model's formula on the family's shapes, which the train loop's MFU uses."""
    from mmtrain.llava_ov.config import LlavaOVModelConfig
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.models.flops import training_flops_per_token

    shapes = LLAVA_OV.model_shapes(LlavaOVModelConfig())  # the defaults: Aquila-VL-2B
    f = training_flops_per_token(shapes, 12288)
    attn = 3 * 28 * 2 * 2 * 6144 * 1536
    assert 6 * 1.5e9 < f - attn < 6 * 1.6e9
    # attention grows linearly with the sequence: doubling it adds exactly one more `attn`
    assert training_flops_per_token(shapes, 2 * 12288) - f == pytest.approx(attn)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_gives_identical_loss_and_grads(pair, granularity):
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.models.megatron_config import ParallelOptions

    _, model, cfg = pair
    rows, pv, sizes = hf_image_inputs(images())
    results = []
    for opts in (ParallelOptions(), ParallelOptions(recompute_granularity=granularity)):
        m = LlavaOVModel(cfg, options=opts)
        m.load_state_dict(model.state_dict())
        m.train()
        batch = hf_inputs_to_batch(cfg, rows[1][None], pv[1:2], sizes[1:2])
        batch.labels = torch.cat([rows[1][None][:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        out, loss_fn = forward_step(iter([batch]), m)
        loss_sum, n, _ = loss_fn(out)
        loss_sum.backward()
        # (vision ln_post is unused by the LLaVA-OV features: no grad)
        results.append((loss_sum.detach(), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert set(g0) == set(g1) and len(g0) > 40
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-5), k


def test_no_init_build_keeps_megatron_tp_metadata(pair):
    """Conversion/inference skip the random init; the TP tags megatron relies on must remain."""
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.models.megatron_config import ParallelOptions

    _, _, cfg = pair

    def tags(m):
        return {
            n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
            for n, p in m.named_parameters()
        }

    ref = tags(LlavaOVModel(cfg))
    assert sum(t for t, _ in ref.values()) > 10
    assert tags(LlavaOVModel(cfg, options=ParallelOptions(perform_initialization=False))) == ref
