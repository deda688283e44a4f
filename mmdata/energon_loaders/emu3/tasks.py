"""Emu3's two training tasks as token sequences with their loss targets (unshifted).

Understanding (image(s) + conversation -> answer), in the chat format of transformers' Emu3
chat template (the one Emu3-Chat-hf ships; the Emu3 reference's `"You are a helpful
assistant. USER: {image}{text}. ASSISTANT:"` is its one-turn case) with Emu3's eos closing
each answer:

    [bos]{system} USER: <img>…<img>{question} ASSISTANT: {answer}[eos] USER: {question} ASSISTANT: {answer}[eos]

Each message is rendered as the template does: the system text without a role, "USER: " with
the turn's images first (the template renders images before text; the `<image>` placeholders
and one newline after each are taken out of the question), "ASSISTANT: " then the answer, each
message followed by one space. So the prompt of the first answer is exactly the template's
`add_generation_prompt` output, "… ASSISTANT:". Loss: on " {answer}" and its [eos] only.

Generation (caption -> image), as the Emu3 reference's text-to-image data and transformers'
`Emu3Processor(return_for_image_generation=True)` prompt, followed by what the model must
generate (the reference's prefix-constrained decoding: rows, eof, eoi, eos):

    [bos]{caption}[boi]"H*W"[img] v v … v [eol] … v [eol] [eof] [eoi] [eos]

Loss: on the visual tokens and the structure tokens the model generates (eol, eof, eoi, eos),
not on the caption nor the given size header. For classifier-free guidance the caption is
replaced by the unconditional prompt (empty by default) with probability `p_uncond` (task
encoder).

The whole rendered text is tokenized in one call (as the HF processor does), `<image>` is one
special token expanded into its serialised block (`serialize.image_ids`); every id comes from
the tokenizer.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from mmdata.energon_loaders.labels import IGNORE_INDEX
from mmdata.energon_loaders.emu3.serialize import IMAGE_PLACEHOLDER, Emu3Vocab, hf_text_encoder, image_ids
from mmdata.energon_loaders.sequence import (
    ConversationError,
    TokenSequence,
    conversation_turns,
    encode_with_offsets,
    turn_role,
)
from mmdata.packing.emu3_geometry import (
    DEFAULT_SYSTEM_PROMPT,
    GENERATION,
    UNDERSTANDING,
)  # (the Emu3 reference's prompt)

_PLACEHOLDER_RE = re.compile(re.escape(IMAGE_PLACEHOLDER) + r"\n?")

TASKS = (UNDERSTANDING, GENERATION)


def generation_caption(conversations: Sequence[dict], num_images: int) -> str | None:
    """The caption of a record usable for text-to-image: exactly one image and one exchange
    (a human turn, then the answer describing the image, e.g. a captioning record); the answer
    is the caption. None for anything else (multi-turn, several or no images)."""
    turns = [t for t in conversations if turn_role(t) != "system"]
    if num_images != 1 or len(turns) != 2:
        return None
    roles = [turn_role(t) for t in turns]
    answer = turns[1].get("value", turns[1].get("content"))
    if roles != ["user", "assistant"] or not isinstance(answer, str) or not answer.strip():
        return None
    return answer.strip()


class Emu3Tasks:
    """Turns records into Emu3 token sequences with a given HF tokenizer (an Emu3 one)."""

    def __init__(self, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.vocab = Emu3Vocab.from_tokenizer(tokenizer)
        self.system_prompt = system_prompt
        self.encode_text = hf_text_encoder(tokenizer)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.vocab.eos)

    # -- understanding -----------------------------------------------------------------------

    def messages(self, conversations: Sequence[dict]) -> list[tuple[str, str]]:
        """LLaVA turns -> [(role, text)], the default system prompt first unless one is given."""
        out = conversation_turns(conversations, self.system_prompt)
        if any(role == "assistant" and IMAGE_PLACEHOLDER in value for role, value in out):
            raise ConversationError("media_in_assistant", "image placeholder in an assistant turn")
        return out

    def render(self, conversations: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text (placeholders still in it) and the character ranges that
        take loss (each answer with its eos)."""
        text, loss = "", []
        for role, value in self.messages(conversations):
            if role == "system":
                text += value + " "
            elif role == "user":
                n = value.count(IMAGE_PLACEHOLDER)
                text += "USER: " + IMAGE_PLACEHOLDER * n + _PLACEHOLDER_RE.sub("", value) + " "
            else:
                text += "ASSISTANT:"
                start = len(text)
                text += " " + value + self.eos_text
                loss.append((start, len(text)))
                text += " "
        return text, loss

    def understanding(self, conversations: Sequence[dict], grids: Sequence[np.ndarray]) -> TokenSequence:
        text, loss = self.render(conversations)
        ids, offsets = encode_with_offsets(self.tokenizer, text)
        v = self.vocab
        out_ids: list[np.ndarray] = [np.array([v.bos], dtype=np.int64)]
        out_labels: list[np.ndarray] = [np.array([IGNORE_INDEX], dtype=np.int64)]
        spans: list[tuple[str, int, int]] = []
        pos, image_i, span_i = 1, 0, 0
        for tid, (start, end) in zip(ids, offsets):
            if tid == v.placeholder:
                if image_i >= len(grids):
                    raise ConversationError(
                        "media_mismatch", f"more {IMAGE_PLACEHOLDER} placeholders than images ({len(grids)})"
                    )
                block = self.image_block(grids[image_i])
                out_ids.append(block)
                out_labels.append(np.full(len(block), IGNORE_INDEX, dtype=np.int64))
                spans.append(("image", pos, len(block)))
                pos += len(block)
                image_i += 1
                continue
            while span_i < len(loss) and start >= loss[span_i][1]:
                span_i += 1
            in_loss = span_i < len(loss) and loss[span_i][0] <= start and end <= loss[span_i][1]
            out_ids.append(np.array([tid], dtype=np.int64))
            out_labels.append(np.array([tid if in_loss else IGNORE_INDEX], dtype=np.int64))
            pos += 1
        if image_i != len(grids):
            raise ConversationError(
                "media_mismatch", f"{image_i} {IMAGE_PLACEHOLDER} placeholders but {len(grids)} images"
            )
        return TokenSequence(np.concatenate(out_ids), np.concatenate(out_labels), spans)

    def image_block(self, grid: np.ndarray) -> np.ndarray:
        """One image's serialised block ([boi] "H*W" [img] rows [eof] [eoi])."""
        try:
            return image_ids(np.asarray(grid), self.vocab, self.encode_text)
        except ValueError as exc:
            raise ConversationError("bad_grid", str(exc)) from exc

    # -- generation --------------------------------------------------------------------------

    def generation(self, caption: str, grid: np.ndarray) -> TokenSequence:
        v = self.vocab
        prompt = np.asarray([v.bos, *self.encode_text(caption)] if caption else [v.bos], dtype=np.int64)
        block = self.image_block(grid)
        ids = np.concatenate([prompt, block, [v.eos]]).astype(np.int64)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        # the model generates everything after [img]: rows (visual + eol), eof, eoi, then eos
        first = len(prompt) + int(np.flatnonzero(block == v.img)[0]) + 1
        labels[first:] = ids[first:]
        return TokenSequence(ids, labels, [("image", len(prompt), len(block))])


def pick_task(u: float, weights: dict[str, float], can_generate: bool) -> str | None:
    """The task of one sample from a uniform draw `u` in [0, 1): generation with probability
    w_gen / (w_gen + w_und) when the record can be a text-to-image sample, else understanding;
    None when the record fits no task with a positive weight."""
    w_und, w_gen = float(weights.get(UNDERSTANDING, 0.0)), float(weights.get(GENERATION, 0.0))
    if can_generate and w_gen > 0 and u * (w_und + w_gen) < w_gen:
        return GENERATION
    return UNDERSTANDING if w_und > 0 else None
