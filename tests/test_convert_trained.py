"""A checkpoint trained a few steps by `mmtrain` and exported with `mmtrain convert mcore-to-hf`
loads in transformers and reproduces mmtrain's logits (issue 5 acceptance). Slow: it runs the
real training CLI on real shards first."""

from __future__ import annotations

import pytest
import torch

from mmdata.energon_loaders.llava_ov import anyres

pytestmark = pytest.mark.slow


def test_trained_checkpoint_exports_to_transformers(tmp_path, shards_dir):
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmtrain.cli import main as cli
    from mmtrain.llava_ov.load import load_llava_ov
    from tests.fixtures_training import train
    from tests.llava_tiny import images

    tok = build_tiny_qwen2_tokenizer(tmp_path / "tokenizer")
    run_dir = tmp_path / "run"
    train(run_dir, shards_dir, tok, "train.iters=3", "checkpoint.interval=3")
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "3"
    out = tmp_path / "hf"
    assert cli(["convert", "mcore-to-hf", "--model", "llava-ov", "--src", str(ckpts), "--dst", str(out)]) == 0

    ours = load_llava_ov(ckpts)
    cfg = ours.cfg
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(out).eval()
    im = anyres.process_image(
        images()[0],
        cfg.max_tiles,
        image_size=cfg.vision.image_size,
        patch_size=cfg.vision.patch_size,
        grid_max=cfg.grid_max,
    )
    ids = torch.cat([torch.tensor([1, 2, 3]), torch.full((im.num_tokens,), cfg.image_token_id), torch.tensor([4, 5])])[
        None
    ]
    pv = im.pixel_values[None]
    sizes = torch.tensor([list(im.image_size)])
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv, image_sizes=sizes).logits
    got = ours(input_ids=ids, pixel_values=pv, image_sizes=sizes)
    assert got.shape == ref.shape == (1, ids.shape[1], cfg.llm.vocab_size)
    assert (got - ref).abs().max().item() <= 1e-4
    # trained weights, not the initial ones: training moved the projector away from init
    assert ours.model.vision_projection.encoder.linear_fc1.weight.abs().sum() > 0
