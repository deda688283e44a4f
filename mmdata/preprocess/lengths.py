"""The per-sample length index: how many LLM positions each written sample takes, so packing can
be planned offline (`mmdata pack-plan`) instead of guessed by an online buffer.

- image tokens: the LLaVA-OneVision loader's own arithmetic (`mmdata.media_layout`: anyres_math.py,
  media.py; torch-free, so the scan tasks never import torch) on the image sizes the validator read
  from the headers: a single image is anyres (base tile + grid, anyres_max_9), each image of a
  multi-image sample one base tile, a video its sampled frames (at most 32) pooled to 14 x 14
  plus one newline;
- text tokens: with `--tokenizer DIR` exactly what the loader's `ChatTokenizer` makes of the
  conversation (Qwen2 chat template with the default system prompt, media placeholders not
  counted); without one, an estimate (`estimate_text_tokens`);
- vision tiles: what the vision tower encodes for the sample (1 + grid tiles of an anyres image,
  one tile per image of a multi-image sample, one per sampled video frame): its share of the
  vision work, which vision-aware balancing spreads (packing/balance.py).

`DIR/lengths.parquet` has one row per written sample in output order: `index` (the global
sample index; the shard key is `f"{index:010d}"`), `shard` (its shard's number), `text_tokens`,
`image_tokens`, `total_tokens`, `vision_tiles` (int32). Its metadata names how text was counted
(`mmdata.text_tokens`: `tokenizer` or `estimate`). The driver writes it (length_index.py).
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from mmdata.energon_loaders.llava_ov.chat_template import (
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    ChatTokenizer,
    ConversationError,
)
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.media_layout.media import media_tiles, media_tokens
from mmdata.shard_format import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

CJK_CHARS_PER_TOKEN = 1.5
OTHER_CHARS_PER_TOKEN = 4.0
TURN_OVERHEAD = 5  # <|im_start|> role "\n" ... <|im_end|> "\n"
SYSTEM_TOKENS = 6  # "You are a helpful assistant." in a Qwen2 vocabulary


#: CJK ideographs (+ extension A/B, compatibility) and CJK punctuation, counted in C by `re`
_CJK = re.compile("[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\U00020000-\U0002a6df]")


def estimate_text_tokens(conversations: list[dict]) -> int:
    """The estimate used without --tokenizer: per turn 5 template tokens plus the text at 1.5
    CJK characters or 4 other characters per token (placeholders not counted), plus the default
    system turn (6 + 5) unless the record has one: the usual rates of BPE vocabularies like
    Qwen2's for English and Chinese text, not a measurement. Use --tokenizer for exact counts."""
    total = 0 if conversations and conversations[0]["from"] == "system" else SYSTEM_TOKENS + TURN_OVERHEAD
    for turn in conversations:
        text = turn["value"]
        if "<" in text:
            text = text.replace(IMAGE_PLACEHOLDER, "").replace(VIDEO_PLACEHOLDER, "")
        cjk = 0 if text.isascii() else len(_CJK.findall(text))
        total += TURN_OVERHEAD + math.ceil(cjk / CJK_CHARS_PER_TOKEN + (len(text) - cjk) / OTHER_CHARS_PER_TOKEN)
    return total


COUNTING_TOKENIZER_NAME = "counting-tokenizer.json"


def write_counting_tokenizer(folder: str | Path, work: str | Path) -> str:
    """Save the `--tokenizer` folder's tokenizer as the scan tasks count with it; returns the
    path to hand them. transformers imports torch on load (seconds per Ray worker), so the driver,
    which loads it anyway to check it, writes its fast backend (exactly what the loader's
    `encode_with_offsets` encodes with) and the ids `ChatTokenizer` reads into one JSON file that
    the workers load with `tokenizers` alone. A tokenizer without a fast backend is counted from
    its folder (with transformers)."""
    hf = load_local_tokenizer(folder, "--tokenizer")
    if getattr(hf, "backend_tokenizer", None) is None:
        return str(Path(folder).resolve())
    chat = ChatTokenizer(hf)  # as the loader builds it (which may add tokens to `hf`): then save
    ids = (chat.im_start_id, chat.im_end_id, chat.image_token_id, chat.video_token_id)
    doc = {
        "backend": hf.backend_tokenizer.to_str(),
        "unk_token_id": hf.unk_token_id,
        "pad_token_id": hf.pad_token_id,
        "token_ids": dict(zip((IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN), ids)),
    }
    out = Path(work) / COUNTING_TOKENIZER_NAME
    out.write_text(json.dumps(doc, sort_keys=True))
    return str(out)


class _SavedTokenizer:
    """A `write_counting_tokenizer` file with the attributes `ChatTokenizer` reads."""

    def __init__(self, path: str):
        doc = json.loads(Path(path).read_text())
        self.backend_tokenizer = Tokenizer.from_str(doc["backend"])
        self.unk_token_id, self.pad_token_id = doc["unk_token_id"], doc["pad_token_id"]
        self._ids = doc["token_ids"]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._ids[token] if token in self._ids else self.backend_tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


@lru_cache(maxsize=2)
def _chat_tokenizer(path: str):
    """The counting `ChatTokenizer` of a `write_counting_tokenizer` result (a file, torch-free) or
    of a tokenizer folder (transformers)."""
    if Path(path).is_file():
        return ChatTokenizer(_SavedTokenizer(path))
    return ChatTokenizer(load_local_tokenizer(path, "--tokenizer"))


class LengthCounter:
    """(text tokens, media tokens, vision tiles) of a normalised record; one per scan task."""

    def __init__(self, tokenizer: str | None = None):
        self.tokenizer = tokenizer

    def __call__(self, record: dict) -> tuple[int, int, int]:
        images, videos = media_tokens(record)
        media, tiles = sum(images) + sum(videos), media_tiles(record)
        if self.tokenizer is None:
            return estimate_text_tokens(record["conversations"]), media, tiles
        try:
            toks = _chat_tokenizer(self.tokenizer).tokenize(record["conversations"], images, videos)
        except ConversationError:  # the loader skips such a record; count what the text would be
            return estimate_text_tokens(record["conversations"]), media, tiles
        return len(toks) - sum(n for _, _, n in toks.media_spans), media, tiles


# ----------------------------------------------------------------------------- the index file

LENGTHS_DTYPE = np.dtype("<i4")  # per shard work file: rows of (text_tokens, image_tokens, vision_tiles)
LENGTHS_COLUMNS = 3
