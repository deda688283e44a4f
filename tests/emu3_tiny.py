"""Tiny offline Emu3 assets shared by the Emu3 tests (fixtures registered in tests/conftest.py).

`emu3_tok_dir`: the tiny Emu3-layout tokenizer; `tiny_vq_dir`: the tiny random VQ (seed 0);
`emu3_dev_shards`: 16 records in our shard format covering every path of the tokenizing job
(RGB/RGBA/L/P images, sizes that are not multiples of 8, multi-image, text-only, undecodable
bytes, an aspect ratio the processor refuses, a video); `token_dir`: those shards through
`mmdata tokenize-images` (2 CPUs, 3 samples per chunk, the length index counted with
`emu3_tok_dir`); `demo_token_dir`: the conftest's
synthetic Infinity-MM shards tokenized the same way (what Emu3 trains on in the tests and the
demo). Session-scoped (built once per session), read-only. `emu3_hf` (module-scoped): a tiny HF
Emu3 saved with its tokenizer and VQ; `hf_emu3_generate`: transformers' text-to-image generation.
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.cli_runs import flags, run_module
from tests.session_fixtures import session_fixture

# transformers' Emu3 chat template (the one Emu3-Chat-hf ships and transformers' processor tests use)
HF_EMU3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% "
    "endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TEST_IMAGE_AREA = 4096  # 64x64 pixels: ~8x8 grids keep the VQ cheap on CPU
DEV_SAMPLES_PER_SHARD = 8
KINDS = ("rgb_jpeg", "rgba_l_pair", "palette", "text_only", "broken", "too_wide", "video", "same_size_pair")
EXPECTED_REASONS = {
    "broken": "image_decode_error",
    "too_wide": "image_unsupported_size",
    "video": "video_not_supported",
}


def encode_image(rng: np.random.Generator, w: int, h: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    if mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    elif mode == "RGBA":
        img = img.convert("RGBA")
        alpha = np.full((h, w), 255, dtype=np.uint8)
        alpha[: h // 2] = 90
        img.putalpha(Image.fromarray(alpha, "L"))
    elif mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def dev_samples(n: int = 16, seed: int = 0) -> list:
    from mmdata.dev.shards import DevSample

    rng = np.random.default_rng(seed)

    def conv(k: int) -> list[dict]:
        return [
            {"from": "human", "value": "<image>\n" * k + "What is in the picture?"},
            {"from": "gpt", "value": "Some coloured noise."},
        ]

    out = []
    for i in range(n):
        kind, sid = KINDS[i % len(KINDS)], f"{KINDS[i % len(KINDS)]}-{i}"
        if kind == "rgb_jpeg":
            out.append(DevSample(sid, conv(1), [("jpg", encode_image(rng, 101 + i, 61, fmt="JPEG"))]))
        elif kind == "rgba_l_pair":
            out.append(
                DevSample(
                    sid, conv(2), [("png", encode_image(rng, 37, 53, "RGBA")), ("png", encode_image(rng, 64, 64, "L"))]
                )
            )
        elif kind == "palette":
            out.append(DevSample(sid, conv(1), [("png", encode_image(rng, 90, 45, "P"))]))
        elif kind == "text_only":
            out.append(DevSample(sid, [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]))
        elif kind == "broken":
            out.append(DevSample(sid, conv(1), [("jpg", b"\xff\xd8 not really a jpeg")]))
        elif kind == "too_wide":
            out.append(DevSample(sid, conv(1), [("png", encode_image(rng, 402, 2))]))
        elif kind == "video":
            out.append(
                DevSample(
                    sid,
                    [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Nothing."}],
                    video=("mp4", b"\0\0\0\x18ftypmp42"),
                )
            )
        else:
            out.append(
                DevSample(
                    sid, conv(2), [("png", encode_image(rng, 80, 80)), ("jpg", encode_image(rng, 80, 80, fmt="JPEG"))]
                )
            )
    return out


def run_tokenize_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`mmdata tokenize-images` in a subprocess (its own Ray instance, nothing left in pytest)."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    return run_module("mmdata.vision_tokens.cli", "--no-progress", *args, env=env, check=check)


def tokenize_args(shards: Path, vq: Path, out: Path, *extra: str, **options: object) -> list[str]:
    """`mmdata tokenize-images` arguments at the test image area: `extra` as given, then `options`
    as flags (`chunk_samples=3` -> `--chunk-samples 3`, see tests/cli_runs.py)."""
    return [str(shards), *flags(vision_tokenizer=vq, output=out, image_area=TEST_IMAGE_AREA), *extra, *flags(**options)]


@session_fixture
def emu3_tok_dir(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_emu3_tokenizer import build_tiny_emu3_tokenizer

    return build_tiny_emu3_tokenizer(tmp_path_factory.mktemp("emu3_tok") / "tok")


@session_fixture
def tiny_vq_dir(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_vq_model import build_tiny_vq

    return build_tiny_vq(tmp_path_factory.mktemp("tiny_vq") / "vq", seed=0)


@session_fixture
def emu3_dev_shards(tmp_path_factory) -> Path:
    from mmdata.dev.shards import write_dev_shards

    return write_dev_shards(
        tmp_path_factory.mktemp("emu3_dev") / "shards", dev_samples(), samples_per_shard=DEV_SAMPLES_PER_SHARD
    )


@session_fixture
def token_dir(tmp_path_factory, emu3_dev_shards, tiny_vq_dir, emu3_tok_dir) -> Path:
    """With the length index (`--tokenizer`): the runs compared with it pass the same option."""
    out = tmp_path_factory.mktemp("emu3_tokens") / "tokens"
    run_tokenize_cli(
        *tokenize_args(emu3_dev_shards, tiny_vq_dir, out, num_cpus=2, chunk_samples=3, tokenizer=emu3_tok_dir)
    )
    return out


@functools.lru_cache(maxsize=4)
def hf_reference(vq_dir: Path, image_area: int):
    """transformers' own Emu3 image processor and VQ model, loaded their own way: the oracle."""
    from transformers import Emu3ImageProcessor, Emu3VQVAE

    proc = Emu3ImageProcessor.from_pretrained(vq_dir, min_pixels=image_area, max_pixels=image_area)
    return proc, Emu3VQVAE.from_pretrained(vq_dir).eval()


def hf_codes(proc, vq, image: Image.Image) -> np.ndarray:
    """`Emu3VQVAE.encode(Emu3ImageProcessor(image))` for one image."""
    import torch

    inputs = proc(images=[image], return_tensors="pt")
    with torch.no_grad():
        return vq.encode(inputs["pixel_values"], inputs["image_sizes"]).image_tokens[0].numpy()


#: the 2-layer decoder (hidden 64, 4 heads over 2 KV groups) of the conversion and parity tests
TWO_LAYERS = dict(layers=2, hidden=64, heads=4, kv_heads=2)


def tiny_hf_emu3(
    tok,
    vq_dir,
    *,
    layers: int = 1,
    hidden: int = 32,
    heads: int = 2,
    kv_heads: int = 1,
    seed: int = 0,
    noise: float = 0.0,
    max_positions: int = 2048,
):
    """A tiny random Emu3ForConditionalGeneration over this tokenizer, with the tiny VQ's weights;
    `noise` perturbs every text-model tensor (norms and all) so conversions cannot pass by luck."""
    import torch

    from benchmarks.tiny_models import random_hf_emu3

    torch.manual_seed(seed)
    kw = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, max_positions=max_positions)
    return random_hf_emu3(tok, vq_dir, **kw, noise=noise)


def save_hf_emu3(model, tok_dir: Path, vq_dir: Path, out: Path) -> Path:
    """An HF Emu3 dir as a hub checkpoint has it: weights, config, tokenizer, image processor."""
    import shutil

    model.save_pretrained(out)
    for f in (*tok_dir.iterdir(), vq_dir / "preprocessor_config.json"):
        shutil.copy2(f, out / f.name)
    return out


@session_fixture
def demo_token_dir(tmp_path_factory, shards_dir, tiny_vq_dir) -> Path:
    """The conftest's preprocessed synthetic Infinity-MM shards (the demo's kind of data: captions,
    multi-turn and multi-image chats, text-only records) through `mmdata tokenize-images`."""
    out = tmp_path_factory.mktemp("emu3_demo_tokens") / "tokens"
    run_tokenize_cli(*tokenize_args(shards_dir, tiny_vq_dir, out, "--num-cpus", "2"))
    return out


@pytest.fixture(scope="module")
def emu3_hf(emu3_tok_dir, tiny_vq_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(emu3_tok_dir)
    model = tiny_hf_emu3(tok, tiny_vq_dir, layers=2, hidden=64, heads=4, kv_heads=2, seed=1, noise=0.05)
    return save_hf_emu3(model, emu3_tok_dir, tiny_vq_dir, tmp_path_factory.mktemp("gen_emu3") / "hf"), model


def hf_emu3_generate(model, prompt_ids, negative_ids, rows, cols, scale):
    """transformers' Emu3 text-to-image generation as its docs (and the Emu3 reference) run it."""
    import torch

    from mmtrain.emu3.hf_reference import emu3_prefix_constraint

    vocab = model.model.vocabulary_mapping
    visual = vocab.image_tokens
    cfg = model.config.text_config
    eol, eof, eoi = vocab.vocab_map["<|extra_200|>"], vocab.vocab_map["<|extra_201|>"], vocab.vocab_map["<|image end|>"]
    img = vocab.vocab_map["<|image token|>"]

    allowed = emu3_prefix_constraint(rows, cols, img, eol, eof, eoi, cfg.eos_token_id, cfg.pad_token_id, visual)

    ids = torch.as_tensor(prompt_ids)[None]
    kw = dict(guidance_scale=scale, negative_prompt_ids=torch.as_tensor(negative_ids)[None]) if scale != 1 else {}
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=(cols + 1) * rows + 10, do_sample=False, prefix_allowed_tokens_fn=allowed, **kw
        )
    return out[0, ids.shape[1] :]
