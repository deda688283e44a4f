"""LLaVA-OV's tokenizer check before training (`FamilySpec.check_tokenizer`, run by preflight):
the `<image>`/`<video>` ids against the recipe, an HF or megatron `checkpoint.load` and the
LLM's vocabulary rows. Reads checkpoints, so it lives outside the light spec module."""

from __future__ import annotations

import logging
from typing import Any

from mmdata.energon_loaders.emu3.serialize import has_visual_tokens
from mmdata.energon_loaders.llava_ov.chat_template import IMAGE_TOKEN, VIDEO_TOKEN, token_id
from mmtrain.config.schema import Recipe
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.conversion import llava_source
from mmtrain.llava_ov.spec import media_token_problems, prepare_tokenizer, vocab_too_small
from mmtrain.models.state_dict_adapter import ConversionError
from mmtrain.runtime.checkpoint.layout import iteration_of, resolve_checkpoint
from mmtrain.runtime.checkpoint.weights import load_model_config_dict

log = logging.getLogger(__name__)


def check_tokenizer(recipe: Recipe, tokenizer: Any) -> list[str]:
    """Before training (FamilySpec.check_tokenizer): an Emu3 tokenizer is named as such; the
    tokenizer's `<image>`/`<video>` ids, added as the loader adds them when the tokenizer lacks
    them, fill the recipe's null ids (logged) and must equal pinned ones, and an HF `checkpoint.load`'s ids (it is
    validated here, before any
    rank starts); the LLM's vocabulary rows must hold them."""
    m: LlavaOVModelConfig = recipe.model
    if has_visual_tokens(tokenizer):  # its missing <image>/<video> would otherwise read as an id mismatch
        return [
            f"tokenizer.path: the tokenizer at {recipe.tokenizer.path} is an Emu3 tokenizer (it holds Emu3's visual "
            "tokens); mmtrain llava-ov needs the tokenizer of its LLM (e.g. the Qwen2 tokenizer of checkpoint.load); "
            "Emu3 token shards are trained with `mmtrain emu3`"
        ]
    added = prepare_tokenizer(tokenizer)
    image_id, video_id = token_id(tokenizer, IMAGE_TOKEN), token_id(tokenizer, VIDEO_TOKEN)
    problems = media_token_problems(m, image_id, video_id, recipe.tokenizer.path)
    if problems:
        return problems
    if added:
        log.info(
            "tokenizer at %s has no %s: added as special token(s) (as the loader does)",
            recipe.tokenizer.path,
            " / ".join(added),
        )
    if m.image_token_id is None or m.video_token_id is None:
        log.info(
            "model.image_token_id=%d, model.video_token_id=%d: from the tokenizer at %s",
            image_id,
            video_id,
            recipe.tokenizer.path,
        )
    m.image_token_id, m.video_token_id = image_id, video_id
    load = recipe.checkpoint.load
    try:
        hf_start = _hf_start(load)
    except ConversionError as err:
        return [f"checkpoint.load: {err}"]
    if hf_start is not None and (hf_start.image_token_id, hf_start.video_token_id) != (image_id, video_id):
        return [
            f"checkpoint.load: {load} has <image>/<video> at ids {hf_start.image_token_id}/{hf_start.video_token_id}, "
            f"the tokenizer at {recipe.tokenizer.path} at {image_id}/{video_id} (train with the checkpoint's own "
            f"tokenizer: tokenizer.path={load})"
        ]
    if max(image_id, video_id) >= m.llm.vocab_size:
        have = hf_start.llm.vocab_size if hf_start is not None else _saved_rows(load)
        return [vocab_too_small(m.llm.vocab_size, max(image_id, video_id) + 1, len(tokenizer), recipe, have)]
    return []


def _hf_start(load: str | None) -> LlavaOVModelConfig | None:
    """The model config of an HF `checkpoint.load` as it will be loaded (media rows added for a
    LLaVA-NeXT checkpoint; its tensors and config keys validated): refused here, before any rank
    starts. None for no or a megatron starting point (preflight checks those)."""
    try:
        kind, point = resolve_checkpoint(load) if load else (None, None)
    except FileNotFoundError:
        return None  # reported by preflight's starting-point check
    if kind != "hf":
        return None
    return llava_source(point)[0]


def _saved_rows(load: str | None) -> int | None:
    """The embedding rows of a megatron `checkpoint.load`, from its saved model config."""
    try:
        _, point = resolve_checkpoint(load)
        return int(load_model_config_dict(point.parent, iteration_of(point))["llm"]["vocab_size"])
    except (FileNotFoundError, OSError, KeyError, TypeError, ValueError):
        return None
