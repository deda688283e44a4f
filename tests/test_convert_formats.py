"""`mmtrain convert` exports and sources that load everywhere (issue 30): the LLaVA-OV export
loads with transformers' processor and tiles as our loader does, pickle `.bin` HF sources are
read (single and sharded), a checkpoint of the wrong kind or family is one line with exit 2,
and third-party warnings stay off stderr (the ranks a conversion spawns included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

torch.set_num_threads(1)

from tests.llava_tiny import IMAGE_SIZE, PATCH, export_processor, has_torchvision, hf_llava, images  # noqa: E402
from tests.fixtures_convert import convert_cli  # noqa: E402

IMAGE_ID, VIDEO_ID = 783, 784  # the tiny Qwen2 tokenizer's <image>/<video>
#: what `mmtrain convert` printed before: optional accelerators absent, megatron deprecations
NOISE = ("Transformer Engine", "Apex", "Megatron-FSDP", "ShardedTensor", "warnings.warn", "DeprecationWarning")


def _mmtrain(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MMTRAIN_VERBOSE"}
    return subprocess.run(
        [sys.executable, "-m", "mmtrain.cli", "convert", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )


def _no_noise(stderr: str) -> None:
    noisy = [line for line in stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy


@pytest.fixture(scope="module")
def hf_tok_dir(tmp_path_factory):
    """A tiny LLaVA-OV HF dir with a real tokenizer whose media ids are the config's."""
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    d = tmp_path_factory.mktemp("hf_tok")
    model = hf_llava(seed=3, image_token=IMAGE_ID, video_token=VIDEO_ID)
    model.save_pretrained(d)
    build_tiny_qwen2_tokenizer(d)
    return d, model


@pytest.fixture(scope="module")
def exported(hf_tok_dir, tmp_path_factory):
    """hf-to-mcore then mcore-to-hf (a subprocess: its stderr is checked for warnings)."""
    src, _ = hf_tok_dir
    ckpt, out = tmp_path_factory.mktemp("ckpt_tok"), tmp_path_factory.mktemp("out") / "hf"
    assert convert_cli("hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(ckpt)) == 0
    proc = _mmtrain("mcore-to-hf", "--model", "llava-ov", "--src", str(ckpt), "--dst", str(out))
    assert proc.returncode == 0, proc.stderr
    return ckpt, out, proc.stderr


def test_export_has_the_processor_and_tiles_as_our_loader(exported):
    from mmdata.energon_loaders.llava_ov import anyres

    _, out, stderr = exported
    _no_noise(stderr)
    assert "wrote shard 1 (" in stderr  # progress of the export, in the CLI's own log
    if not has_torchvision():  # the export says what transformers' AutoProcessor needs to load it
        assert "AutoProcessor needs torchvision" in stderr and "torchvision==0.28.0" in stderr
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / name).is_file(), name
    settings = json.loads((out / "processor_config.json").read_text())
    assert settings["vision_aspect_ratio"] == "anyres_max_9" and settings["vision_feature_select_strategy"] == "full"
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "LlavaOnevisionImageProcessor"
    assert pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    assert pre["size"] == {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    proc = export_processor(out)
    assert proc.tokenizer.convert_tokens_to_ids(["<image>", "<video>"]) == [IMAGE_ID, VIDEO_ID]
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], add_generation_prompt=True
    )
    assert prompt.count("<image>") == 1 and prompt.endswith("<|im_start|>assistant\n")
    for im in images()[:2]:  # wide, tall
        ours = anyres.process_image(im, 9, image_size=IMAGE_SIZE, patch_size=PATCH)
        ref = proc(images=[im], text=["<image>"], return_tensors="pt")
        assert int((ref["input_ids"] == IMAGE_ID).sum()) == ours.num_tokens
        assert ref["pixel_values"][0].shape == ours.pixel_values.shape
        assert (ref["pixel_values"][0] - ours.pixel_values).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- pickle .bin sources


def _bin_dir(src: Path, dst: Path, shards: int) -> Path:
    """`src` (safetensors) as pytorch_model.bin, or `shards` shards + pytorch_model.bin.index.json."""
    from safetensors.torch import load_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    if shards == 1:
        torch.save(sd, dst / "pytorch_model.bin")
        return dst
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: sd[k] for k in keys[i::shards]}
        torch.save(part, dst / name)
        weight_map.update({k: name for k in part})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.unit
@pytest.mark.parametrize("shards", [1, 3])
def test_bin_checkpoints_read_like_safetensors(hf_tok_dir, tmp_path, shards):
    from mmtrain.models.hf_io import SafetensorsReader, source_dtype

    src, _ = hf_tok_dir
    b = _bin_dir(src, tmp_path / "bin", shards)
    ref, got = SafetensorsReader(src), SafetensorsReader(b)
    assert got.keys() == ref.keys()
    for k in sorted(ref.keys())[:20]:
        assert got.shape(k) == ref.shape(k) and torch.equal(got.get(k), ref.get(k)), k
    assert got.dtype() == ref.dtype() == source_dtype(b) == "float32"


def test_sharded_bin_converts_at_tp2_quietly(hf_tok_dir, tmp_path):
    """The CLI on a sharded .bin dir, 2 spawned ranks: no internal error, no warnings."""
    from mmtrain.models.hf_io import SafetensorsReader

    src, _ = hf_tok_dir
    b = _bin_dir(src, tmp_path / "bin", 2)
    proc = _mmtrain("hf-to-mcore", "--model", "llava-ov", "--src", str(b), "--dst", str(tmp_path / "ck"), "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    _no_noise(proc.stderr)
    progress = [x for x in proc.stderr.splitlines() if x.startswith("hf-to-mcore: ")]  # rank 0's lines only
    assert [x.split(" (")[0].split(" [")[0] for x in progress] == [
        "hf-to-mcore: building the model",
        "hf-to-mcore: filling it from the source",
        "hf-to-mcore: saving the megatron checkpoint",
    ], progress
    out = tmp_path / "hf"
    assert convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(tmp_path / "ck"), "--dst", str(out)) == 0
    a, c = SafetensorsReader(src), SafetensorsReader(out)
    assert a.keys() == c.keys() and all(torch.equal(a.get(k), c.get(k)) for k in a.keys())


# ----------------------------------------------------------------------------- the wrong kind of checkpoint


def _fake_megatron(d: Path, model_config: dict) -> Path:
    """The layout of a megatron checkpoint (latest, iter_*/model, model_config.yaml); no weights."""
    from mmtrain.runtime.checkpoint.weights import MODEL_CONFIG

    (d / "iter_0000000" / "model").mkdir(parents=True)
    (d / "latest").write_text("0")
    (d / "iter_0000000" / MODEL_CONFIG).write_text(yaml.safe_dump(model_config))
    return d


def test_wrong_kind_or_family_is_one_line_exit_2(hf_tok_dir, exported, tmp_path, capsys):
    from dataclasses import asdict

    from mmtrain.emu3.config import Emu3ModelConfig

    src, _ = hf_tok_dir
    ckpt, _, _ = exported
    emu3_hf = tmp_path / "emu3_hf"
    emu3_hf.mkdir()
    (emu3_hf / "config.json").write_text(
        json.dumps({"model_type": "emu3", "architectures": ["Emu3ForConditionalGeneration"]})
    )
    emu3_ckpt = _fake_megatron(tmp_path / "emu3_ckpt", asdict(Emu3ModelConfig()))
    dst = str(tmp_path / "o")
    cases = [
        (["hf-to-mcore", "--model", "llava-ov", "--src", str(ckpt)], "is a megatron checkpoint, not an HF one"),
        (
            ["mcore-to-hf", "--model", "llava-ov", "--src", str(src)],
            "is an HF checkpoint (config.json), not a megatron",
        ),
        (["hf-to-mcore", "--model", "emu3", "--src", str(src)], "is an HF llava-ov checkpoint"),
        (["hf-to-mcore", "--model", "llava-ov", "--src", str(emu3_hf)], "is an HF emu3 checkpoint"),
        (["mcore-to-hf", "--model", "emu3", "--src", str(ckpt)], "is a megatron llava-ov checkpoint"),
        (["mcore-to-hf", "--model", "llava-ov", "--src", str(emu3_ckpt)], "is a megatron emu3 checkpoint"),
        (
            ["hf-to-mcore", "--model", "llava-ov", "--src", str(tmp_path)],
            "is not an HF checkpoint: it has no config.json",
        ),
        (["mcore-to-hf", "--model", "llava-ov", "--src", str(tmp_path)], "is not a megatron checkpoint"),
    ]
    for argv, said in cases:
        assert convert_cli(*argv, "--dst", dst) == 2, argv
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "o").exists()
