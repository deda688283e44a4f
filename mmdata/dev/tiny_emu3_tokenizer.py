"""A tiny tokenizer with Emu3's vocabulary layout, built offline with `tokenizers`.

Emu3's vocabulary is Qwen's byte-level BPE followed by its specials and the VQ codebook as
visual tokens. This keeps that layout at toy size (`mmdata tiny-tokenizer --family emu3`):

    BPE merges (Qwen2 pre-tokenizer regex, trained on a built-in sample)
    <|endoftext|> <|im_start|> <|im_end|>
    <image> <|extra_1|> … <|extra_204|>      (205 extras; <image> in <|extra_0|>'s slot, as
                                               transformers' Emu3 conversion does)
    <|image token|> <|image start|> <|image end|>
    <|visual token 000000|> … <|visual token {N-1:06d}|>   (N = the VQ codebook size, contiguous)

with the roles of the real one: bos `<|extra_203|>`, eos `<|extra_204|>`, pad `<|endoftext|>`,
eol `<|extra_200|>`, eof `<|extra_201|>`, and the named tokens transformers' Emu3Processor reads
(`image_token`, `boi_token`, `eoi_token`, `image_wrapper_token`, `eof_token`). Loadable with
`AutoTokenizer.from_pretrained`, deterministic (same arguments, same bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

from mmdata.dev.bpe import BUILTIN_TEXTS, special_token_entry, train_bpe_tokenizer
from mmdata.dev.tiny_vq import DEFAULT_CODEBOOK_SIZE  # the tiny VQ's codebook
from mmdata.energon_loaders.emu3 import serialize
from mmdata.energon_loaders.llava_ov.chat_template import IM_END, IM_START

EXTRA_SPECIAL_TOKENS = {
    "image_token": serialize.IMAGE_PLACEHOLDER,
    "boi_token": serialize.BOI,
    "eoi_token": serialize.EOI,
    "image_wrapper_token": serialize.IMG,
    "eof_token": serialize.EOF,
}


def emu3_special_tokens(codebook_size: int) -> list[str]:
    """Every token after the BPE merges, in id order."""
    extras = [serialize.IMAGE_PLACEHOLDER] + [f"<|extra_{i}|>" for i in range(1, serialize.NUM_EXTRA_TOKENS)]
    visual = [serialize.visual_token(i) for i in range(codebook_size)]
    return [serialize.ENDOFTEXT, IM_START, IM_END, *extras, serialize.IMG, serialize.BOI, serialize.EOI, *visual]


def build_tiny_emu3_tokenizer(
    out_dir: str | Path, codebook_size: int = DEFAULT_CODEBOOK_SIZE, vocab_size: int = 1024
) -> Path:
    """Train and save the tiny Emu3-layout tokenizer; returns `out_dir`."""
    if not 1 <= codebook_size <= 1_000_000:
        raise ValueError(f"codebook size must be in 1..1000000, got {codebook_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = emu3_special_tokens(codebook_size)
    tok = train_bpe_tokenizer(list(BUILTIN_TEXTS) * 4, vocab_size, special_tokens=specials)
    tok.save(str(out / "tokenizer.json"))
    first = tok.token_to_id(serialize.ENDOFTEXT)
    added = {str(first + i): special_token_entry(t) for i, t in enumerate(specials)}
    named = {
        "bos_token": serialize.BOS,
        "eos_token": serialize.EOS,
        "pad_token": serialize.ENDOFTEXT,
        "unk_token": None,
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",  # Emu3's text vocabulary is Qwen's byte-level BPE
        "added_tokens_decoder": added,
        **named,
        "extra_special_tokens": EXTRA_SPECIAL_TOKENS,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: t for k, t in named.items() if t is not None}, indent=2, sort_keys=True) + "\n"
    )
    return out


def run(args) -> int:  # `mmdata tiny-tokenizer --family emu3`
    size = args.codebook_size or DEFAULT_CODEBOOK_SIZE
    out = build_tiny_emu3_tokenizer(args.output, codebook_size=size, vocab_size=args.vocab_size)
    print(f"wrote a tiny Emu3-layout tokenizer ({size} visual tokens) to {out}")
    return 0
