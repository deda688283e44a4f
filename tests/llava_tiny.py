"""Tiny random HF LLaVA-OV / Qwen2 / SigLIP models and inputs for the parity tests (no downloads),
and the HF processor our anyres layout is checked against."""

from __future__ import annotations


import numpy as np
import torch
from PIL import Image
from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

from benchmarks.tiny_models import text_config, vision_config
from mmdata.energon_loaders.llava_ov import anyres

IMAGE_SIZE, PATCH = 30, 14
IMAGE_TOKEN, VIDEO_TOKEN = 998, 999


def hf_llava(
    seed: int = 0,
    tie: bool = True,
    vocab_size: int = 1000,
    image_token: int = IMAGE_TOKEN,
    video_token: int = VIDEO_TOKEN,
    text: dict | None = None,
    vision: dict | None = None,
):
    """`text` / `vision`: overrides of `text_config()` / `vision_config()` (e.g. heads for TP=4)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaOnevisionConfig(
        text_config=text_config(tie_word_embeddings=tie, vocab_size=vocab_size, **(text or {})),
        vision_config=vision_config(IMAGE_SIZE, PATCH, **(vision or {})),
        image_token_index=image_token,
        video_token_index=video_token,
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(IMAGE_SIZE, 6)],
        tie_word_embeddings=tie,
    )
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # make every tensor non-trivial (norms and biases default to 1/0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(47, 95), (120, 61), (30, 30)]  # (h, w): wide, tall, exactly one tile
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_image_inputs(imgs: list[Image.Image], seed: int = 0, text_len: int = 7, image_token: int = IMAGE_TOKEN):
    """One sample per image: [text] <image>*n [text]; returns input_ids, pixel_values (padded), image_sizes."""
    g = torch.Generator().manual_seed(seed)
    procs = [anyres.process_image(im, 9, image_size=IMAGE_SIZE, patch_size=PATCH) for im in imgs]
    max_tiles = max(p.num_tiles for p in procs)
    pv = torch.zeros(len(procs), max_tiles, 3, IMAGE_SIZE, IMAGE_SIZE)
    rows = []
    for i, p in enumerate(procs):
        pv[i, : p.num_tiles] = p.pixel_values
        pre = torch.randint(0, 990, (text_len,), generator=g)
        post = torch.randint(0, 990, (text_len,), generator=g)
        rows.append(torch.cat([pre, torch.full((p.num_tokens,), image_token), post]))
    return rows, pv, torch.tensor([list(p.image_size) for p in procs])


def hf_greedy_answer(model, inputs, tok, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` of one prompt's `inputs` (the chat's stop and pad tokens):
    the new tokens."""
    stops = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **stops)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def has_torchvision() -> bool:
    """transformers' LlavaOnevisionVideoProcessor (and so AutoProcessor on a LLaVA-OV dir) needs it."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def export_processor(d):
    """transformers' AutoProcessor of the HF export `d` where torchvision is installed; without it
    (no video processor can be built: tests/test_llava_export_processor.py checks AutoProcessor
    says so) the same LlavaOnevisionProcessor from the saved parts, its video check relaxed."""
    import json
    from pathlib import Path

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, LlavaOnevisionProcessor

    if has_torchvision():
        return AutoProcessor.from_pretrained(d)

    class Images(LlavaOnevisionProcessor):
        def check_argument_for_proper_class(self, name, argument):
            return (
                None
                if name == "video_processor" and argument is None
                else super().check_argument_for_proper_class(name, argument)
            )

    d = Path(d)
    settings = json.loads((d / "processor_config.json").read_text())
    assert settings.pop("processor_class") == "LlavaOnevisionProcessor"
    settings = {k: v for k, v in settings.items() if not isinstance(v, dict)}
    return Images(
        image_processor=AutoImageProcessor.from_pretrained(d),
        tokenizer=AutoTokenizer.from_pretrained(d),
        video_processor=None,
        chat_template=(d / "chat_template.jinja").read_text(),
        **settings,
    )


class ImagesOnlyProcessor(LlavaOnevisionProcessor):
    """The real HF processor; only its class check for the (absent, torchvision-based) video
    processor is relaxed, since we pass images only."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def hf_image_processor(image_size: int = 384, grid_max: int = 6) -> LlavaOnevisionImageProcessorPil:
    return LlavaOnevisionImageProcessorPil(
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"height": image_size, "width": image_size},
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(image_size, grid_max)],
    )


def hf_llava_processor(tok):
    return ImagesOnlyProcessor(
        image_processor=hf_image_processor(IMAGE_SIZE, 6),
        tokenizer=tok,
        video_processor=None,
        num_image_tokens=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy="full",
    )
