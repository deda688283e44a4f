"""Emu3's token stream for text with images, as pure functions over a resolved vocabulary.

One image becomes (transformers' Emu3Processor followed by Emu3Model's image-token
substitution, and the Emu3 reference's `processing_emu3.py`):

    [boi] "H*W" [img] v(0,0) … v(0,W-1) [eol] … v(H-1,0) … v(H-1,W-1) [eol] [eof] [eoi]

where "H*W" is plain text (tokenized by the text tokenizer) and v(r,c) is the visual token of
VQ code grid[r, c]. A sample is `[bos]` + its text with every `<image>` placeholder replaced by
one such block, in order.

Every id comes from the tokenizer: the named roles from its special-token attributes (what
Emu3Processor reads: bos_token, boi_token, eoi_token, image_wrapper_token, eof_token), eol
(which has no attribute) and the visual tokens from their names in its vocabulary. The strings
below are Emu3's vocabulary convention, used to build the tiny tokenizer and as the fallback
for a tokenizer that lacks an attribute; they never stand for an id.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Emu3's vocabulary convention (the reference's tokenization_emu3.py / emu3_vision_tokens.txt;
# transformers' conversion script names the roles the same way).
ENDOFTEXT = "<|endoftext|>"  # pad
NUM_EXTRA_TOKENS = 205  # <|extra_0|> ... <|extra_204|>
BOS = "<|extra_203|>"
EOS = "<|extra_204|>"
EOL = "<|extra_200|>"  # ends every row of visual tokens
EOF = "<|extra_201|>"  # ends the last row
IMG = "<|image token|>"  # after "H*W", before the rows (transformers: image_wrapper_token)
BOI = "<|image start|>"
EOI = "<|image end|>"
# The placeholder transformers' processor expands and its model replaces with visual tokens; the
# HF conversion puts it in <|extra_0|>'s slot. It is also our shards' image placeholder.
IMAGE_PLACEHOLDER = "<image>"
VISUAL_TOKEN_TEMPLATE = "<|visual token {:06d}|>"
_VISUAL_RE = re.compile(r"<\|visual token (\d{6})\|>")

# tokenizer attribute -> convention string, for the roles Emu3Processor reads off the tokenizer
_ROLE_ATTRS = {
    "bos": ("bos_token", BOS),
    "eos": ("eos_token", EOS),
    "pad": ("pad_token", ENDOFTEXT),
    "img": ("image_wrapper_token", IMG),
    "boi": ("boi_token", BOI),
    "eoi": ("eoi_token", EOI),
    "eof": ("eof_token", EOF),
    "placeholder": ("image_token", IMAGE_PLACEHOLDER),
}


def visual_token(code: int) -> str:
    return VISUAL_TOKEN_TEMPLATE.format(code)


def has_visual_tokens(tokenizer) -> bool:
    """Whether a tokenizer holds Emu3's visual tokens (an Emu3 tokenizer: what another family's
    preflight names, rather than finding its own tokens missing)."""
    return visual_token(0) in tokenizer.get_vocab()


@dataclass(frozen=True)
class Emu3Vocab:
    """The ids Emu3's serialisation needs, resolved once from a tokenizer."""

    bos: int
    eos: int
    pad: int
    img: int
    boi: int
    eoi: int
    eol: int
    eof: int
    placeholder: int
    visual: np.ndarray = field(repr=False)  # VQ code -> token id (int64, length = codebook size)

    @property
    def codebook_size(self) -> int:
        return len(self.visual)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Emu3Vocab:
        """Read the ids off an HF tokenizer (or anything with `get_vocab()` and token attributes)."""
        vocab: dict[str, int] = tokenizer.get_vocab()

        def resolve(what: str, token: str | None) -> int:
            tid = vocab.get(str(token)) if token is not None else None
            if tid is None:
                raise ValueError(f"tokenizer has no Emu3 {what} token {token!r}: not an Emu3 tokenizer?")
            return int(tid)

        roles = {
            role: resolve(role, getattr(tokenizer, attr, None) or default)
            for role, (attr, default) in _ROLE_ATTRS.items()
        }
        codes = {int(m.group(1)): tid for name, tid in vocab.items() if (m := _VISUAL_RE.fullmatch(name))}
        if not codes:
            raise ValueError("tokenizer has no visual tokens ('<|visual token 000000|>' ...): not an Emu3 tokenizer?")
        if sorted(codes) != list(range(len(codes))):
            raise ValueError(f"tokenizer's visual tokens are not codes 0..{len(codes) - 1} without gaps")
        visual = np.array([codes[c] for c in range(len(codes))], dtype=np.int64)
        return cls(**roles, eol=resolve("eol", EOL), visual=visual)


TextEncoder = Callable[[str], Sequence[int]]


def hf_text_encoder(tokenizer) -> TextEncoder:
    """Plain text -> ids without added specials (what the processor's tokenizer call does to
    the text between special tokens)."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def image_ids(grid: np.ndarray, vocab: Emu3Vocab, encode_text: TextEncoder) -> np.ndarray:
    """The token block of one image from its (H, W) VQ code grid."""
    if grid.ndim != 2 or 0 in grid.shape:
        raise ValueError(f"a VQ code grid must be a non-empty 2-D array, got shape {grid.shape}")
    if int(grid.max()) >= vocab.codebook_size or int(grid.min()) < 0:
        raise ValueError(f"VQ codes outside the tokenizer's {vocab.codebook_size} visual tokens")
    h, w = grid.shape
    rows = np.empty((h, w + 1), dtype=np.int64)
    rows[:, :w] = vocab.visual[grid.astype(np.int64)]
    rows[:, w] = vocab.eol
    return np.concatenate([image_header(h, w, vocab, encode_text), rows.ravel(), [vocab.eof, vocab.eoi]])


def image_header(h: int, w: int, vocab: Emu3Vocab, encode_text: TextEncoder) -> np.ndarray:
    """`[boi] "H*W" [img]`: what precedes the rows of an (h, w) grid."""
    size = np.asarray(encode_text(f"{h}*{w}"), dtype=np.int64)
    return np.concatenate([[vocab.boi], size, [vocab.img]]).astype(np.int64)


def generation_prompt(text: str, h: int, w: int, vocab: Emu3Vocab, encode_text: TextEncoder) -> np.ndarray:
    """`[bos] text [boi] "H*W" [img]`: the prompt of an (h, w) image (transformers'
    `Emu3Processor(return_for_image_generation=True)`); the model generates the rows next."""
    head = np.asarray([vocab.bos, *encode_text(text)] if text else [vocab.bos], dtype=np.int64)
    return np.concatenate([head, image_header(h, w, vocab, encode_text)])


def serialize(
    text: str, grids: Sequence[np.ndarray], vocab: Emu3Vocab, encode_text: TextEncoder, *, add_bos: bool = True
) -> np.ndarray:
    """`[bos]` + `text` with its i-th `<image>` replaced by the block of `grids[i]`."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"text has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders but {len(grids)} image grids")
    out: list[np.ndarray] = [np.array([vocab.bos], dtype=np.int64)] if add_bos else []
    for i, piece in enumerate(pieces):
        if piece:
            out.append(np.asarray(encode_text(piece), dtype=np.int64))
        if i < len(grids):
            out.append(image_ids(grids[i], vocab, encode_text))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
