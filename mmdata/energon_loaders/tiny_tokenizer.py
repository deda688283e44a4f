"""A tiny, deterministic Qwen2-style tokenizer built offline with `tokenizers`.

Tests, `make demo` and the tiny training recipes must not download anything, yet they need an
HF tokenizer directory that behaves like Qwen2's: byte-level BPE with Qwen's pre-tokenizer
regex, ChatML specials, `<image>`/`<video>` placeholders as single special tokens, and a chat
template. This builds one in well under a second from a built-in English+Chinese sample.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mmdata.shard_format import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_TOKEN = IMAGE_PLACEHOLDER  # the shards' placeholders are single special tokens
VIDEO_TOKEN = VIDEO_PLACEHOLDER
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN]
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2's pre-tokenizer split pattern (digits one at a time, contractions, words, punctuation).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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

_BUILTIN_TEXTS = [
    "You are a helpful assistant.",
    "Describe the image in detail. What is shown in this picture?",
    "The image shows a red bus parked next to a tall building on a sunny day.",
    "A cat is sleeping on a wooden table near the window, and a cup of coffee stands beside it.",
    "Question: How many people are in the photo? Answer: There are three people in the photo.",
    "Please read the text in the chart and summarise the main trend from 2019 to 2024.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = % $ # @ ! ? , . ; :",
    "What color is the car? The car is blue. Where is the dog? The dog is in the garden.",
    "Write a short poem about the sea, the wind and the stars at night.",
    "请详细描述这张图片。图片中有什么？",
    "这张图片展示了一只在草地上奔跑的小狗，背景是蓝色的天空和白色的云。",
    "问题：图中有几个人？回答：图中有三个人，他们正在公园里散步。",
    "请阅读图表中的文字，并总结二零一九年到二零二四年的主要趋势。",
    "你好，我是一个乐于助人的助手。今天天气很好，我们去公园吧。",
    "视频中的人在做什么？他正在厨房里做饭。",
]


def _train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Specials go after the BPE vocabulary, as in Qwen2 (<|endoftext|> first).
    tok.add_special_tokens(special_tokens)
    return tok


def build_tiny_qwen2_tokenizer(
    out_dir: str | Path, texts: Iterable[str] | None = None, vocab_size: int = 1024
) -> Path:
    """Train and save a tiny Qwen2-style tokenizer directory; returns `out_dir`.

    Deterministic: the same texts and vocab size give byte-identical files.
    Loadable offline with `transformers.AutoTokenizer.from_pretrained(out_dir)`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = list(_BUILTIN_TEXTS) * 4 + [t for t in (texts or []) if t]
    tok = _train_tokenizer(corpus, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN],
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
        json.dumps({"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": [IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN]}, indent=2, sort_keys=True)
        + "\n"
    )
    return out


def add_arguments(parser) -> None:  # `mmdata tiny-tokenizer`
    parser.add_argument("--output", required=True, help="directory to write the HF tokenizer files into")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size (default 1024)")
    parser.add_argument("--family", choices=["qwen2", "emu3"], default="qwen2",
                        help="qwen2 (default): LLaVA-OV's; emu3: Emu3's vocabulary layout (specials + visual tokens)")
    parser.add_argument("--codebook-size", type=int, default=None,
                        help="emu3: number of visual tokens, the VQ codebook size (default: the tiny VQ's)")


def run(args) -> int:
    if args.family == "emu3":
        from mmdata.energon_loaders.emu3 import tiny_tokenizer

        return tiny_tokenizer.run(args)
    if args.codebook_size is not None:
        from mmdata.errors import UserError

        raise UserError("--codebook-size applies to --family emu3 only")
    out = build_tiny_qwen2_tokenizer(args.output, vocab_size=args.vocab_size)
    print(f"wrote a tiny Qwen2-style tokenizer to {out}")
    return 0
