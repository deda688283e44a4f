"""The `<image>`/`<video>` tokens of a LLaVA-OV model, read from its tokenizer.

Published LLM-only and LLaVA-NeXT-format checkpoints (Qwen2/2.5 tokenizers; LLaVA-NeXT itself
splices media with the out-of-vocabulary id -200) ship tokenizers without these tokens. As
transformers' LLaVA-OneVision conversion does, they are added as special tokens after the
existing vocabulary, and the embedding/output rows grow to hold them when needed; the new rows
are the mean of the existing rows (deterministic, so a conversion is reproducible).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from mmdata.energon_loaders.llava_ov.chat_template import IMAGE_TOKEN, VIDEO_TOKEN, add_media_tokens, token_id
from mmtrain.models.state_dict_adapter import ConversionError

log = logging.getLogger(__name__)

#: files any HF tokenizer directory has one of
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclass
class MediaTokens:
    tokenizer: Any  # the resolved transformers tokenizer (media tokens present)
    image_token_id: int
    video_token_id: int
    added: list[str]  # tokens this resolution added, in order ([] when the tokenizer had both)


def has_tokenizer(path: str | os.PathLike) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def resolve_media_tokens(tokenizer_dir: str | os.PathLike) -> MediaTokens:
    """Load the tokenizer at `tokenizer_dir` and make sure it has `<image>` and `<video>` (added
    as special tokens, unnormalised, when missing)."""
    if not has_tokenizer(tokenizer_dir):
        raise ConversionError(
            f"{tokenizer_dir}: no tokenizer ({' / '.join(_TOKENIZER_FILES)}); the <image>/<video> "
            "token ids are read from it"
        )
    return _with_media_tokens(_load_tokenizer(tokenizer_dir), tokenizer_dir)


def _load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # it warns that a LLaVA-NeXT config.json is no transformers model type
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as exc:  # a broken tokenizer dir: say which and why, in one line
        raise ConversionError(f"{tokenizer_dir}: cannot load its tokenizer: {type(exc).__name__}: {exc}") from None
    finally:
        hf_logging.set_verbosity(level)


def _with_media_tokens(tok: Any, tokenizer_dir: str | os.PathLike) -> MediaTokens:
    added = add_media_tokens(tok)
    if added:
        log.info(
            "tokenizer at %s had no %s: added as special token(s) with id(s) %s",
            tokenizer_dir,
            " / ".join(added),
            [token_id(tok, t) for t in added],
        )
    return MediaTokens(tok, token_id(tok, IMAGE_TOKEN), token_id(tok, VIDEO_TOKEN), added)


def check_config_media_ids(hf_dir: str | os.PathLike, image_id: int, video_id: int) -> Optional[MediaTokens]:
    """A checkpoint whose config pins the media ids (transformers' `image_token_index` /
    `video_token_index`) must agree with the tokenizer shipped beside it, as the loader will
    resolve it (media tokens added when missing): otherwise image features land on the wrong
    tokens. Returns that resolved tokenizer, or None when the dir has none that loads (weights-only
    copies, stub tokenizer configs): then the run's own tokenizer is checked at training time."""
    if not has_tokenizer(hf_dir):
        return None
    try:
        tokens = _with_media_tokens(_load_tokenizer(hf_dir), hf_dir)
    except ConversionError as exc:
        log.warning("%s; its config's media token ids (%d / %d) are not checked against it", exc, image_id, video_id)
        return None
    wrong = [
        f"{key}={want} but its tokenizer maps {tok} to {got}"
        for key, want, tok, got in (
            ("image_token_index", image_id, IMAGE_TOKEN, tokens.image_token_id),
            ("video_token_index", video_id, VIDEO_TOKEN, tokens.video_token_id),
        )
        if want != got
    ]
    if wrong:
        raise ConversionError(
            f"{hf_dir}/config.json: " + "; ".join(wrong) + " (config and tokenizer are from "
            "different models: put the model's own tokenizer beside it)"
        )
    return tokens


def vocab_rows_for(tokens: MediaTokens, rows: int) -> int:
    """Embedding rows a model needs: its own, or enough to hold the media ids."""
    return max(rows, tokens.image_token_id + 1, tokens.video_token_id + 1, len(tokens.tokenizer))


def grow_rows(weight: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """`weight` [r, h] -> [rows, h]: new rows are the mean of the existing ones."""
    have = weight.shape[0]
    if have >= rows:
        return weight
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    log.info(
        "%s: %d new row(s) %d..%d for the media tokens, initialised to the mean of the %d existing rows",
        name,
        rows - have,
        have,
        rows - 1,
        have,
    )
    return torch.cat([weight, mean.expand(rows - have, -1)], dim=0).contiguous()
