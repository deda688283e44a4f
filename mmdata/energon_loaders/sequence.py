"""One sample's token stream before packing (ids, unshifted loss targets, media spans), the
over-length policy every family applies to it, and a record's conversation as (role, text)
turns. Light (numpy only): recipe code may import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

#: label value that takes no loss (transformers' and megatron's convention)
IGNORE_INDEX = -100


class ConversationError(ValueError):
    """A sample that cannot be rendered (unknown role, placeholder/media count mismatch...);
    `reason` is the counted skip reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class TokenSequence:
    """One sample's token stream before packing."""

    input_ids: np.ndarray  # [L] int64, media expanded
    labels: np.ndarray  # [L] int64, UNshifted targets, IGNORE_INDEX where no loss
    #: per media, in stream order: (kind, e.g. "image" | "video", start position, length)
    media_spans: list[tuple[str, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class TruncationResult:
    tokens: TokenSequence | None  # None when the sample must be dropped
    outcome: str  # "fits" | "truncated" | "too_long_media" | "no_loss_after_truncation"


def apply_length_policy(tokens: TokenSequence, max_length: int) -> TruncationResult:
    """Over-length policy: cut trailing text tokens to `max_length` if the cut is after the last
    media token and leaves at least one loss token; otherwise drop (never cut an image)."""
    if len(tokens) <= max_length:
        return TruncationResult(tokens, "fits")
    media_end = max((start + n for _, start, n in tokens.media_spans), default=0)
    if media_end > max_length:
        return TruncationResult(None, "too_long_media")
    labels = tokens.labels[:max_length]
    if not (labels != IGNORE_INDEX).any():
        return TruncationResult(None, "no_loss_after_truncation")
    return TruncationResult(TokenSequence(tokens.input_ids[:max_length], labels, tokens.media_spans), "truncated")


#: LLaVA / ShareGPT turn names -> chat roles
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def turn_role(turn: dict) -> str | None:
    """The chat role of one record turn (`from` or `role`), None when unknown."""
    return ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())


def conversation_turns(conversations: Sequence[dict], system_prompt: str) -> list[tuple[str, str]]:
    """A record's turns -> [(role, text)], `system_prompt` first unless the record has its own
    system turn; ConversationError for an unknown role, a non-string value or a late system turn."""
    out: list[tuple[str, str]] = []
    for i, turn in enumerate(conversations):
        role = turn_role(turn)
        if role is None:
            raise ConversationError("bad_role", f"turn {i}: unknown role {turn.get('from')!r}")
        value = turn.get("value", turn.get("content"))
        if not isinstance(value, str):
            raise ConversationError("bad_turn", f"turn {i}: value is not a string")
        if role == "system" and i != 0:
            raise ConversationError("bad_role", f"turn {i}: system turn not first")
        out.append((role, value))
    if not out or out[0][0] != "system":
        out.insert(0, ("system", system_prompt))
    return out


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of `text` without added specials and each token's character span (the fast backend
    when the tokenizer has one), so a chat renderer can give loss to character ranges."""
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if fast is not None:
        enc = fast.encode(text, add_special_tokens=False)
        return list(enc.ids), list(enc.offsets)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
