"""Qwen2 ChatML rendering, tokenization with media expansion, and the loss mask.

Rendering (identical to Qwen2-Instruct's `chat_template`, checked in tests):

    <|im_start|>system\\n{system}<|im_end|>\\n          (default system: LLaVA-OV's)
    <|im_start|>user\\n{human turn}<|im_end|>\\n
    <|im_start|>assistant\\n{gpt turn}<|im_end|>\\n

Loss convention (the clean one; LLaVA-OV's own code also trains on headers and on every
`<|im_start|>`/`<|im_end|>`/"\\n" token even inside user turns, which we do not copy):
- loss on the assistant CONTENT tokens and on the assistant's closing `<|im_end|>` (the model
  must learn to stop);
- no loss on the `<|im_start|>assistant\\n` header, on the "\\n" after `<|im_end|>`, on system
  and user turns, and on image/video tokens.

Each turn is tokenized as one string, so the ids equal tokenizing the whole rendered
conversation (turns are separated by special tokens, which the tokenizer never merges across).
Each `<image>`/`<video>` placeholder is one special token, replaced by `num_tokens` copies of
itself, exactly what `LlavaOnevisionProcessor` does.

Labels returned here are UNshifted targets (label[t] is the loss target for token t); the
batcher shifts them (see batch.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mmdata.energon_loaders.sequence import IGNORE_INDEX, ConversationError, TokenSequence, conversation_turns, encode_with_offsets
from mmdata.energon_loaders.sequence import apply_length_policy as apply_length_policy  # re-export
from mmdata.shard_format import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_TOKEN = IMAGE_PLACEHOLDER  # the shards' placeholders are single special tokens
VIDEO_TOKEN = VIDEO_PLACEHOLDER
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: the token sequence of one LLaVA-OV sample (ids, unshifted labels, media spans)
ChatTokens = TokenSequence


def with_video_placeholder(conversations: Sequence[dict]) -> list[dict]:
    """The turns of a sample with a clip: as LLaVA, a clip without any `<video>` placeholder
    goes before the first human turn. Returns copies of the turns; the input is not changed."""
    out = [dict(t) for t in conversations]
    if not any(VIDEO_TOKEN in str(t.get("value", "")) for t in out):
        for t in out:
            if t.get("from") in ("human", "user"):
                t["value"] = f"{VIDEO_TOKEN}\n{t['value']}"
                break
    return out


def token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one whole token of the vocabulary, else None."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (tid == getattr(tokenizer, "unk_token_id", None) and token not in tokenizer.get_vocab()):
        return None
    return int(tid)


def add_media_tokens(tokenizer: Any) -> list[str]:
    """Give `tokenizer` the `<image>`/`<video>` placeholders it lacks, as unnormalised special
    tokens after its vocabulary (as transformers' LLaVA-OneVision conversion does): published LLM
    tokenizers (Qwen2.5) and LLaVA-NeXT checkpoints have none. Deterministic: every process that
    loads the same tokenizer gets the same ids. Returns the tokens added."""
    added = [t for t in (IMAGE_TOKEN, VIDEO_TOKEN) if token_id(tokenizer, t) is None]
    if added:
        from transformers import AddedToken  # lazy: a Ray worker counting lengths never imports torch

        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True)
    return added


class ChatTokenizer:
    """Renders LLaVA-format conversations into ids + labels with a given HF tokenizer (the
    media placeholders are added to it when missing, see `add_media_tokens`)."""

    def __init__(self, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        add_media_tokens(tokenizer)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, IMAGE_TOKEN, VIDEO_TOKEN)}
        missing = [t for t, i in ids.items() if i is None or i == getattr(tokenizer, "unk_token_id", -1)]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}; add them (as special tokens) first")
        self.im_start_id = int(ids[IM_START])
        self.im_end_id = int(ids[IM_END])
        self.image_token_id = int(ids[IMAGE_TOKEN])
        self.video_token_id = int(ids[VIDEO_TOKEN])
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.im_end_id)

    # -- rendering ---------------------------------------------------------------------------

    def messages(self, conversations: Sequence[dict]) -> list[dict[str, str]]:
        """LLaVA turns -> [{role, content}], default system prompt first unless one is given."""
        return [{"role": r, "content": v} for r, v in conversation_turns(conversations, self.system_prompt)]

    def render(self, conversations: Sequence[dict]) -> str:
        return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in self.messages(conversations))

    # -- tokenization ------------------------------------------------------------------------

    def tokenize(
        self,
        conversations: Sequence[dict],
        image_token_counts: Sequence[int] = (),
        video_token_counts: Sequence[int] = (),
    ) -> ChatTokens:
        """Ids and unshifted labels; `<image>` i expands to image_token_counts[i] tokens."""
        ids_out: list[np.ndarray] = []
        labels_out: list[np.ndarray] = []
        media_spans: list[tuple[str, int, int]] = []
        pos = 0
        image_i = video_i = 0
        for msg in self.messages(conversations):
            header = f"{IM_START}{msg['role']}\n"
            text = f"{header}{msg['content']}{IM_END}\n"
            ids, offsets = encode_with_offsets(self.tokenizer, text)
            is_assistant = msg["role"] == "assistant"
            loss_end = len(text) - 1  # content + <|im_end|>, not the final "\n"
            for tid, (start, end) in zip(ids, offsets):
                if tid == self.image_token_id or tid == self.video_token_id:
                    if is_assistant:
                        raise ConversationError("media_in_assistant", "media placeholder in an assistant turn")
                    kind = "image" if tid == self.image_token_id else "video"
                    counts = image_token_counts if kind == "image" else video_token_counts
                    index = image_i if kind == "image" else video_i
                    if index >= len(counts):
                        raise ConversationError(
                            "media_mismatch", f"more <{kind}> placeholders than {kind}s ({len(counts)})"
                        )
                    n = int(counts[index])
                    if kind == "image":
                        image_i += 1
                    else:
                        video_i += 1
                    ids_out.append(np.full(n, tid, dtype=np.int64))
                    labels_out.append(np.full(n, IGNORE_INDEX, dtype=np.int64))
                    media_spans.append((kind, pos, n))
                    pos += n
                    continue
                target = tid if (is_assistant and start >= len(header) and end <= loss_end) else IGNORE_INDEX
                ids_out.append(np.array([tid], dtype=np.int64))
                labels_out.append(np.array([target], dtype=np.int64))
                pos += 1
        if image_i != len(image_token_counts) or video_i != len(video_token_counts):
            raise ConversationError(
                "media_mismatch",
                f"placeholders ({image_i} <image>, {video_i} <video>) do not match media "
                f"({len(image_token_counts)} images, {len(video_token_counts)} videos)",
            )
        return ChatTokens(np.concatenate(ids_out), np.concatenate(labels_out), media_spans)
