"""What both tiny tokenizers (tiny_tokenizer.py: Qwen2, tiny_emu3_tokenizer.py: Emu3) are made of:
byte-level BPE with Qwen2's pre-tokenizer, trained in well under a second on a built-in English
and Chinese sample, with the family's special tokens after the merges."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenizer split pattern (digits one at a time, contractions, words, punctuation).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BUILTIN_TEXTS = [
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


def train_bpe_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A deterministic byte-level BPE on `texts` (same texts and size, same merges), `special_tokens`
    appended after the merges in the order given (as in Qwen2: `<|endoftext|>` first)."""
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


def special_token_entry(content: str) -> dict:
    """A tokenizer_config.json `added_tokens_decoder` entry: a special token, matched as written."""
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
