"""A tiny, deterministic Qwen2-style tokenizer built offline with `tokenizers` (`mmdata tiny-tokenizer`).

Tests, `make demo` and the tiny training recipes must not download anything, yet they need an
HF tokenizer directory that behaves like Qwen2's: byte-level BPE with Qwen's pre-tokenizer
regex, ChatML specials, `<image>`/`<video>` placeholders as single special tokens, and a chat
template. This builds one in well under a second from a built-in English+Chinese sample.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Iterable

from mmdata.dev import tiny_emu3_tokenizer
from mmdata.dev.bpe import BUILTIN_TEXTS, special_token_entry, train_bpe_tokenizer
from mmdata.energon_loaders.llava_ov.chat_template import (
    DEFAULT_SYSTEM_PROMPT,
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)
from mmdata.errors import UserError

ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN]

# Qwen2-Instruct's ChatML template (default system prompt as LLaVA-OneVision uses it).
# String contents only: our loader renders turns itself and this template is the reference
# that tests compare that rendering against.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_qwen2_tokenizer(
    out_dir: str | Path, texts: Iterable[str] | None = None, vocab_size: int = 1024, media_tokens: bool = True
) -> Path:
    """Train and save a tiny Qwen2-style tokenizer directory; returns `out_dir`.

    Deterministic: the same texts and vocab size give byte-identical files.
    Loadable offline with `transformers.AutoTokenizer.from_pretrained(out_dir)`.
    `media_tokens=False`: without `<image>`/`<video>`, like a published LLM-only (Qwen2.5) or
    LLaVA-NeXT-format checkpoint's tokenizer.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = list(BUILTIN_TEXTS) * 4 + [t for t in (texts or []) if t]
    specials = SPECIAL_TOKENS if media_tokens else [t for t in SPECIAL_TOKENS if t not in (IMAGE_TOKEN, VIDEO_TOKEN)]
    extra = [t for t in specials if t != ENDOFTEXT]
    tok = train_bpe_tokenizer(corpus, vocab_size, specials)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): special_token_entry(t) for t in specials}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": QWEN2_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": extra}, indent=2, sort_keys=True
        )
        + "\n"
    )
    return out


def add_arguments(parser) -> None:  # `mmdata tiny-tokenizer`
    parser.add_argument("--output", required=True, help="directory to write the HF tokenizer files into")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size (default 1024)")
    parser.add_argument(
        "--family",
        choices=["qwen2", "emu3"],
        default="qwen2",
        help="qwen2 (default): LLaVA-OV's; emu3: Emu3's vocabulary layout (specials + visual tokens)",
    )
    parser.add_argument(
        "--codebook-size",
        type=int,
        default=None,
        help="emu3: number of visual tokens, the VQ codebook size (default: the tiny VQ's)",
    )


def run(args) -> int:
    if args.family == "emu3":
        return tiny_emu3_tokenizer.run(args)
    if args.codebook_size is not None:
        raise UserError("--codebook-size applies to --family emu3 only")
    out = build_tiny_qwen2_tokenizer(args.output, vocab_size=args.vocab_size)
    print(f"wrote a tiny Qwen2-style tokenizer to {out}")
    return 0


def resolve_tokenizer(path: str | None) -> Path:
    """`path` if given, else this tiny tokenizer built into a temp dir (notebooks/inspect_dataset.ipynb)."""
    if path:
        return Path(path)
    return build_tiny_qwen2_tokenizer(Path(tempfile.mkdtemp(prefix="mmdata-tok-")))
