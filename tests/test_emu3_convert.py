"""`mmtrain convert --model emu3` and `load_emu3` on a tiny random `Emu3ForConditionalGeneration`
(2 GQA layers, the tiny Emu3 tokenizer's 1503-token vocabulary, padded for megatron): logits and
loss within 1e-4 of HF at TP=1 and TP=2, a bit-identical round trip with the VQ model kept
alongside, export of a checkpoint without a kept VQ, any TP/PP layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)

from tests.emu3_tiny import TWO_LAYERS, save_hf_emu3, tiny_hf_emu3  # noqa: E402
from tests.fixtures_convert import convert_cli, tp2_worker_checks  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(emu3_tok_dir, tiny_vq_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(emu3_tok_dir)
    model = tiny_hf_emu3(tok, tiny_vq_dir, **TWO_LAYERS, seed=1, noise=0.05)
    return save_hf_emu3(model, emu3_tok_dir, tiny_vq_dir, tmp_path_factory.mktemp("hf_emu3") / "hf"), model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("emu3_ckpt") / "ckpt"
    assert convert_cli("hf-to-mcore", "--model", "emu3", "--src", str(hf_dir[0]), "--dst", str(dst)) == 0
    return dst


def _inputs(vocab: int):
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0  # right padding
    return ids, mask


def test_round_trip_is_bit_identical_and_keeps_the_vq(hf_dir, converted, tmp_path):
    from transformers import Emu3ForConditionalGeneration, Emu3VQVAE

    src, model = hf_dir
    out = tmp_path / "hf_out"
    assert convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(converted), "--dst", str(out)) == 0
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b) and any(k.startswith("vqmodel.") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    for name in ("tokenizer.json", "preprocessor_config.json"):
        assert (out / name).is_file()
    reloaded = Emu3ForConditionalGeneration.from_pretrained(out)
    s1, s2 = model.state_dict(), reloaded.state_dict()
    assert set(s1) == set(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    # the VQ model kept next to the megatron weights is a plain Emu3VQVAE dir
    vq = Emu3VQVAE.from_pretrained(converted / "hf_assets" / "vq").state_dict()
    ref = model.model.vqmodel.state_dict()
    assert set(vq) == set(ref) and all(torch.equal(vq[k], ref[k]) for k in ref)


def test_load_emu3_matches_hf_logits(hf_dir, converted):
    from mmtrain.emu3.load import load_emu3

    src, model = hf_dir
    ids, mask = _inputs(model.config.text_config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    for ours in (load_emu3(converted), load_emu3(src)):  # megatron checkpoint; HF dir converted on the fly
        assert not ours.training
        out = ours(ids, attention_mask=mask)
        assert out.shape == ref.shape == (2, 40, 1503)
        assert (out[0] - ref[0]).abs().max().item() <= 1e-4
        assert (out[1, :29] - ref[1, :29]).abs().max().item() <= 1e-4


def test_export_of_a_checkpoint_without_kept_vq(hf_dir, converted, emu3_tok_dir, tiny_vq_dir, tmp_path, capsys):
    from transformers import Emu3ForConditionalGeneration

    src, model = hf_dir
    bare = tmp_path / "bare"  # what training writes: weights and model config, no HF assets
    shutil.copytree(converted, bare, ignore=shutil.ignore_patterns("hf_assets"))
    assert convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(bare), "--dst", str(tmp_path / "x")) == 2
    assert "--vq VQ_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # --vq belongs to export only: argparse refuses it, exit 2
        convert_cli("hf-to-mcore", "--model", "emu3", "--src", str(src), "--dst", str(tmp_path / "y"), "--vq", str(src))
    assert usage.value.code == 2 and "unrecognized arguments: --vq" in capsys.readouterr().err
    out = tmp_path / "out"
    assert (
        convert_cli(
            "mcore-to-hf",
            "--model",
            "emu3",
            "--src",
            str(bare),
            "--dst",
            str(out),
            "--vq",
            str(tiny_vq_dir),
            "--tokenizer",
            str(emu3_tok_dir),
        )
        == 0
    )
    reloaded = Emu3ForConditionalGeneration.from_pretrained(out)
    s1, s2 = model.state_dict(), reloaded.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert json.loads((out / "config.json").read_text())["vocabulary_map"] == model.config.vocabulary_map


def test_tp2_logits_and_loss_match_hf_and_reshard(hf_dir, converted, tmp_path):
    from mmtrain.emu3.load import load_emu3

    src, model = hf_dir
    res = tp2_worker_checks("emu3_tp_worker.py", src, converted, tmp_path)
    assert res["local_vocab_rows"] == 1536 // 2  # 1503 padded to a multiple of 128 x TP, then split
    ids, mask = _inputs(1503)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    assert (load_emu3(tmp_path / "tp2")(ids) - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_cli_converts_at_tp2_pp2(hf_dir, tmp_path):
    """`--tp 2 --pp 2` streams into 4 ranks' shards; the result loads at TP=1/PP=1."""
    from mmtrain.emu3.load import load_emu3

    src, model = hf_dir
    dst = tmp_path / "tp2pp2"
    assert (
        convert_cli("hf-to-mcore", "--model", "emu3", "--src", str(src), "--dst", str(dst), "--tp", "2", "--pp", "2")
        == 0
    )
    ids, _ = _inputs(1503)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    assert (load_emu3(dst)(ids) - ref).abs().max().item() <= 1e-4


def test_bf16_round_trip_keeps_bf16(hf_dir, emu3_tok_dir, tiny_vq_dir, tmp_path):
    """A bf16 Emu3 dir comes back bf16 and bit-identical (the kept VQ too), config.json saying so;
    `--dtype float32` exports fp32."""
    import copy

    from mmtrain.emu3.config import Emu3ModelConfig
    from mmtrain.runtime.hf_conversion import saved_model_config

    src = save_hf_emu3(copy.deepcopy(hf_dir[1]).to(torch.bfloat16), emu3_tok_dir, tiny_vq_dir, tmp_path / "hf_bf16")
    ckpt, out, out32 = tmp_path / "ck", tmp_path / "out", tmp_path / "out32"
    assert convert_cli("hf-to-mcore", "--model", "emu3", "--src", str(src), "--dst", str(ckpt)) == 0
    assert saved_model_config(ckpt, Emu3ModelConfig).params_dtype == "bfloat16"  # recorded
    assert convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(ckpt), "--dst", str(out)) == 0
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]), k
    assert {t.dtype for t in b.values() if t.is_floating_point()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (
        convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(ckpt), "--dst", str(out32), "--dtype", "float32")
        == 0
    )
    c = load_file(out32 / "model.safetensors")
    assert all(c[k].dtype == torch.float32 and torch.equal(a[k].float(), c[k]) for k in a if a[k].is_floating_point())
    assert json.loads((out32 / "config.json").read_text())["dtype"] == "float32"


def _trained_copy(converted: Path, dst: Path, data_paths: list[Path]) -> Path:
    """`converted` as a trained checkpoint: its iteration's trainer state names `data_paths`, as
    the trainer writes it (TrainerState.data = the loader's identity)."""
    from dataclasses import asdict

    from mmtrain.runtime.checkpoint.layout import TRAINER_STATE, iter_dir, read_latest
    from mmtrain.runtime.checkpoint.manager import TrainerState

    shutil.copytree(converted, dst)
    state = TrainerState(step=3, data={"data.paths": [str(p) for p in data_paths]})
    (iter_dir(dst, read_latest(dst)) / TRAINER_STATE).write_text(json.dumps(asdict(state)))
    return dst


def test_export_records_the_token_shards_image_area(converted, tiny_vq_dir, tmp_path, caplog):
    """The exported preprocessor_config.json resizes images to the area the token shards were made
    with (their manifest's image_area), not the VQ dir's default: transformers' image processor of
    the export gives the pixels `mmdata tokenize-images --image-area` gave; unreadable manifests warn."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from mmdata.vision_tokens.vq import load_image_processor
    from tests.emu3_tiny import TEST_IMAGE_AREA

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "manifest.json").write_text(json.dumps({"tool": "mmdata tokenize-images", "image_area": TEST_IMAGE_AREA}))
    ckpt = _trained_copy(converted, tmp_path / "ckpt", [tokens])
    out = tmp_path / "hf"
    with caplog.at_level("INFO"):
        assert convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(ckpt), "--dst", str(out)) == 0
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == pre["max_pixels"] == TEST_IMAGE_AREA
    assert f"image area {TEST_IMAGE_AREA} px" in caplog.text
    image = Image.new("RGB", (64, 64), (120, 30, 200))
    exported = AutoImageProcessor.from_pretrained(out)(image, return_tensors="pt")["pixel_values"]
    tokenized = load_image_processor(tiny_vq_dir, TEST_IMAGE_AREA)(image, return_tensors="pt")["pixel_values"]
    default = load_image_processor(tiny_vq_dir, None)(image, return_tensors="pt")["pixel_values"]
    assert exported.shape == tokenized.shape != default.shape
    assert torch.equal(exported, tokenized)
    # data without a readable manifest: the VQ's bounds stay, with a warning saying so
    caplog.clear()
    ckpt2 = _trained_copy(converted, tmp_path / "ckpt2", [tmp_path / "gone"])
    with caplog.at_level("INFO"):
        assert convert_cli("mcore-to-hf", "--model", "emu3", "--src", str(ckpt2), "--dst", str(tmp_path / "hf2")) == 0
    assert "its --image-area is unknown" in caplog.text and "tokenize-images --image-area" in caplog.text
    kept = json.loads((tiny_vq_dir / "preprocessor_config.json").read_text())
    assert json.loads((tmp_path / "hf2" / "preprocessor_config.json").read_text())["max_pixels"] == kept["max_pixels"]
