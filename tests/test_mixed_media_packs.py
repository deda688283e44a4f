"""Mixed-media packs at micro-batch 2 (issue 32 item 4) and rows moved by vision-aware balancing.

Single-image, multi-image, video and text-only samples, each mix and all of them together, go
through the LLaVA-OV task encoder and are packed two rows per micro-batch, several samples per
row; against the same samples unpacked (one per row), on a tiny random LLaVA-OV model
(tests/llava_tiny.py, converted into ours): every sample's loss is the same, its labels (the loss
mask) are the same, and its media land on the same positions with the same features, with and
without a context-parallel split of the packed stream. Rows moved between micro-batches and
ranks by `RowBalancer` (and through bytes, as the DP exchange sends them) keep every sample's
loss: balancing reorders, it never changes what a sample contributes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

from mmdata.energon_loaders.batch import IGNORE_INDEX  # noqa: E402
from tests.llava_tiny import IMAGE_SIZE, PATCH, hf_llava  # noqa: E402
from tests.fixtures_loader import mp4_bytes, qa  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("megatron_cpu")]
SEQ = 384
TOL = dict(rtol=1e-5, atol=1e-5)


def png_bytes(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _sample(i: int, conversations: list[dict], images: tuple[bytes, ...] = (), video: bytes | None = None):
    from mmdata.energon_loaders.sample import ConversationSample

    return ConversationSample(
        __key__=f"{i:010d}",
        __restore_key__=(),
        __subflavors__=None,
        __sources__=(),
        id=f"s{i}",
        conversations=conversations,
        images=list(images),
        image_names=[f"img{k:02d}.png" for k in range(len(images))],
        video=video,
        source="t",
        meta={},
        provenance={},
    )


KINDS = {
    "single-image": lambda i: _sample(
        i, qa("<image>\nWhat is it?", f"A picture, number {i}."), (png_bytes(20 + 9 * i, 95 - 7 * i, i),)
    ),
    "multi-image": lambda i: _sample(
        i,
        qa("<image><image> Compare." if i % 2 else "<image><image><image> Which?", f"They differ {i}."),
        tuple(png_bytes(20 + i, 40 - i, i + k) for k in range(2 if i % 2 else 3)),
    ),
    "video": lambda i: _sample(i, qa("<video>\nWhat happens?", f"Things move {i}."), (), mp4_bytes(6 + i % 5, seed=i)),
    "text-only": lambda i: _sample(i, qa("Tell me a fact.", f"Fact {i}: the sea is salty.") * (1 + i % 2)),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny tokenizer's task encoder, a tiny random HF LLaVA-OV converted into ours, and 4
    encoded samples of each kind."""
    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.state_dict_adapter import (
        LlavaOVStateDictAdapter,
        llava_config_from_hf,
        normalize_llava_hf_key,
    )
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    tok = build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok") / "tok")
    enc = LlavaOVTaskEncoder(
        str(tok), LlavaOVEncoderConfig(seq_length=SEQ, image_size=IMAGE_SIZE, patch_size=PATCH, max_video_frames=4)
    )
    hf = hf_llava(seed=0, vocab_size=1152, image_token=enc.chat.image_token_id, video_token=enc.chat.video_token_id)
    cfg = llava_config_from_hf(hf.config.to_dict())
    sd = {normalize_llava_hf_key(k): v for k, v in hf.state_dict().items()}
    adapter = LlavaOVStateDictAdapter(cfg)
    model = LlavaOVModel(cfg).eval()
    load_canonical(model, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
    samples = {
        kind: [enc.postencode_sample(enc.preencode_sample(make(10 * j + i))) for i in range(4)]
        for j, (kind, make) in enumerate(KINDS.items())
    }
    return enc, model, samples


def _collate(enc, rows):
    from mmdata.energon_loaders.llava_ov.task_encoder import collate_rows

    return collate_rows(rows, enc.config, enc.chat.pad_token_id)


def _losses(model, batch) -> dict[str, torch.Tensor]:
    """{sample id: [loss sum, label count]} of a batch through the model."""
    from mmtrain.runtime.loss import loss_mask, per_sample_loss_sums

    with torch.no_grad():
        out = model(batch)
    sums = per_sample_loss_sums(out, loss_mask(batch), batch)
    return dict(zip([s for row in batch.sample_ids for s in row], sums))


def _segments(batch) -> dict[str, tuple[int, int]]:
    """{sample id: (start, end)} over the flattened stream (a row's first segments are its samples)."""
    cu = batch.cu_seqlens.tolist()
    s = batch.input_ids.shape[1]
    starts = {}
    for a, e in zip(cu[:-1], cu[1:]):
        starts.setdefault(a // s, []).append((a, e))
    return {sid: starts[r][k] for r, row in enumerate(batch.sample_ids) for k, sid in enumerate(row)}


def _decoder_input(model, batch, cp: int = 1, rank: int = 0) -> torch.Tensor:
    from mmtrain.models.context_parallel import cp_layout, padding_multiple

    with torch.no_grad():
        return model._decoder_input(batch, cp_layout(batch.cu_seqlens, cp, rank, padding_multiple(cp, 1)))[:, 0]


MIXES = [*KINDS, "all mixed"]


@pytest.mark.parametrize("mix", MIXES)
def test_packed_at_micro_batch_2_equals_unpacked(setup, mix):
    enc, model, samples = setup
    chosen = [s for kind in KINDS for s in samples[kind][:2]] if mix == "all mixed" else samples[mix]
    half = len(chosen) // 2
    rows = [chosen[:half], chosen[half:]] if mix != "all mixed" else [chosen[0::2], chosen[1::2]]
    packed = _collate(enc, rows)
    assert packed.input_ids.shape == (2, SEQ) and all(len(r) >= 2 for r in packed.sample_ids)
    alone = {s.id: _collate(enc, [[s]]) for s in chosen}
    # per-sample losses
    got = _losses(model, packed)
    for sid, batch in alone.items():
        torch.testing.assert_close(got[sid], _losses(model, batch)[sid], **TOL)
    # loss mask and media placement: each sample's labels, tokens and decoder input (token
    # embeddings with its media features spliced in) are those of the sample alone
    segments = _segments(packed)
    emb = _decoder_input(model, packed)
    media_ids = torch.tensor([enc.chat.image_token_id, enc.chat.video_token_id])
    for sid, batch in alone.items():
        a, e = segments[sid]
        n = e - a
        assert n == int(batch.cu_seqlens[1])
        assert torch.equal(packed.labels.reshape(-1)[a:e], batch.labels[0, :n])
        assert torch.equal(packed.input_ids.reshape(-1)[a:e], batch.input_ids[0, :n])
        assert (batch.labels[0, n:] == IGNORE_INDEX).all()
        torch.testing.assert_close(emb[a:e], _decoder_input(model, batch)[:n], rtol=0, atol=1e-6)
        on_media = torch.isin(batch.input_ids[0, :n], media_ids)
        if on_media.any():  # the features really are there: not the placeholder's embedding
            plain = model.language_model.embedding(input_ids=batch.input_ids[:, :n], position_ids=None)[:, 0]
            assert (emb[a:e][on_media] - plain[on_media]).abs().amax(dim=-1).min() > 1e-3
    # context parallelism splits the packed two-row stream after splicing: each rank's decoder
    # input is its share of the whole one (its media encoded on the rank that holds them)
    from mmtrain.models.context_parallel import cp_layout

    for cp in (2, 4):
        for rank in range(cp):
            layout = cp_layout(packed.cu_seqlens, cp, rank, 2 * cp)
            real = layout.index < layout.total
            local = _decoder_input(model, packed, cp, rank)
            torch.testing.assert_close(local[real], emb[layout.index[real]], rtol=0, atol=1e-6)


def test_rows_moved_by_balancing_keep_every_sample_loss(setup):
    """Four packed rows in two micro-batches of two ranks, placed by `RowBalancer` (as the
    replicated train loop does, and through bytes as the DP exchange sends them): every sample's
    loss is the same as where it was drawn."""
    from mmtrain.llava_ov.spec import encoder_inputs
    from mmtrain.runtime.row_exchange import RowBalancer

    enc, model, samples = setup
    s = samples
    # rank 0 draws the rows with media, rank 1 two text-only rows
    drawn = [
        [_collate(enc, [s["video"][:2], s["single-image"][:2] + s["multi-image"][:1]])],
        [_collate(enc, [s["text-only"][:2], s["text-only"][2:]])],
    ]
    before = {k: v for mb in (drawn[0][0], drawn[1][0]) for k, v in _losses(model, mb).items()}
    balancer = RowBalancer(210.0, encoder_inputs)
    placed = [balancer.balance_local(drawn, me) for me in (0, 1)]
    tiles = [sum(encoder_inputs(mb) for mb in mine) for mine in placed]
    drawn_tiles = [encoder_inputs(mbs[0]) for mbs in drawn]
    assert max(tiles) - min(tiles) < max(drawn_tiles) - min(drawn_tiles)  # the rows did move
    moved = [m for mine in placed for mb in mine for m in mb.split_rows()]
    after: dict[str, torch.Tensor] = {}
    for mine in placed:
        for mb in mine:
            assert mb.input_ids.shape == (2, SEQ)
            after.update(_losses(model, mb))
            sent = type(mb).join_rows([type(mb).from_bytes(r.to_bytes()) for r in mb.split_rows()])
            for sid, loss in _losses(model, sent).items():
                torch.testing.assert_close(loss, after[sid], rtol=0, atol=0)
    assert sorted(after) == sorted(before) and len(moved) == 4
    for sid in before:
        torch.testing.assert_close(after[sid], before[sid], **TOL)


def test_vision_tiles_known_before_decoding_are_the_tiles_encoded(setup):
    """What the online packer evens (`vision_tiles` of a pre-encoded sample, from the media refs)
    is what the vision tower gets after decoding: tiles of an anyres image, one per image of
    several, one per sampled video frame, none for text."""
    enc, _, samples = setup
    for j, (kind, make) in enumerate(KINDS.items()):
        for i, done in enumerate(samples[kind]):
            pre = enc.preencode_sample(make(10 * j + i))
            assert enc.vision_tiles(pre) == sum(m.prepared.num_tiles for m in done.media), (kind, i)
            assert (enc.vision_tiles(pre) == 0) == (kind == "text-only")
