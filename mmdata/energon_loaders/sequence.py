"""One sample's token stream before packing (ids, unshifted loss targets, media spans) and the
over-length policy every family applies to it. Light (numpy only): recipe code may import it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmdata.energon_loaders.batch import IGNORE_INDEX


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
