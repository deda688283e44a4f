"""LLaVA-OV answers on the shared generation engine (mmtrain/generation/): the prompt from the
checkpoint's own chat template and image layout, image features placed into the prompt's
embeddings, the answer decoded by its tokenizer.

Chat template: the checkpoint's processor template (`chat_template.jinja` / `chat_template.json`,
llava-hf style: content as a list of {"type": "image"} / {"type": "text"} parts), else its
tokenizer's (Qwen2 style: content a string, the image placeholder written as "<image>\\n" before
the question, as LLaVA does); a template that cannot take list content is given the string
form. Without any template the training format (mmdata's Qwen2 ChatML) is used.

Image layout: anyres tiling with the checkpoint's geometry (`image_size`, patch, grid pinpoints,
`anyres_max_N` from its config), normalised with its processor's mean/std, and the placeholder
expanded to the number of features the model lays out - what `LlavaOnevisionProcessor` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import AutoTokenizer

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer
from mmtrain.generation.checkpoint import CheckpointRef, GenerationError, Placement
from mmtrain.generation.engine import GenerationModel, GenerationRequest, GenerationResult, Progress, generate
from mmtrain.generation.sampling import SamplingParams
from mmtrain.llava_ov.conversion import processor_chat_template
from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
from mmtrain.llava_ov.load import load_llava_ov


@dataclass
class LlavaPrompt:
    """A rendered, tokenized prompt: ids with the image placeholder already expanded."""

    input_ids: torch.Tensor  # [T]
    pixel_values: Optional[torch.Tensor] = None  # [tiles, 3, S, S]
    image_size: Optional[tuple[int, int]] = None  # original (height, width)


def _image_stats(d: Path) -> dict:
    """image_mean / image_std of the checkpoint's image processor (SigLIP's when absent)."""
    f = d / "preprocessor_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text(encoding="utf-8"))
    return {k: tuple(cfg[src]) for k, src in (("mean", "image_mean"), ("std", "image_std")) if src in cfg}


class LlavaOVChat:
    """A loaded LLaVA-OV checkpoint with its tokenizer: (question, image) -> answer."""

    def __init__(self, ref: CheckpointRef, placement: Placement, *, tokenizer_dir: Path) -> None:
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as exc:
            raise GenerationError(f"tokenizer {tokenizer_dir}: {exc}") from None
        self.template = processor_chat_template(tokenizer_dir) or self.tokenizer.chat_template
        self.image_stats = _image_stats(tokenizer_dir)
        inference = load_llava_ov(ref.path, ref.iteration)
        placement.apply(inference.model)
        self.llava, self.cfg, self.placement = inference.model, inference.cfg, placement
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.cfg.image_token_id)
        if (
            not isinstance(self.image_token, str)
            or self.tokenizer.convert_tokens_to_ids(self.image_token) != self.cfg.image_token_id
        ):
            raise GenerationError(
                f"the tokenizer {tokenizer_dir} has no image token with the model's id "
                f"{self.cfg.image_token_id}: not this checkpoint's tokenizer?"
            )
        if len(self.tokenizer) > self.cfg.llm.vocab_size:
            raise GenerationError(
                f"the tokenizer {tokenizer_dir} has {len(self.tokenizer)} tokens, the model "
                f"{self.cfg.llm.vocab_size}: not this checkpoint's tokenizer?"
            )
        self.stop_token_ids = self._stop_ids(tokenizer_dir)
        self.model = GenerationModel(
            decoder=self.llava.language_model, vocab_size=self.cfg.llm.vocab_size, embed_prompt=self.embed
        )

    def _stop_ids(self, d: Path) -> tuple[int, ...]:
        ids = set() if self.tokenizer.eos_token_id is None else {int(self.tokenizer.eos_token_id)}
        f = d / "generation_config.json"
        if f.is_file():
            eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
            ids |= {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        return tuple(sorted(ids))

    # ------------------------------------------------------------------ prompt
    def render(self, question: str, has_image: bool, system: Optional[str] = None) -> str:
        """The chat-templated prompt text (image placeholder not expanded), ending with the
        assistant's turn header."""
        head = [{"role": "system", "content": system}] if system is not None else []
        if self.template is None:
            turns = ([{"from": "system", "value": system}] if system is not None else []) + [
                {"from": "human", "value": (f"{self.image_token}\n" if has_image else "") + question}
            ]
            return ChatTokenizer(self.tokenizer).render(turns) + "<|im_start|>assistant\n"
        parts = ([{"type": "image"}] if has_image else []) + [{"type": "text", "text": question}]
        try:
            text = self.tokenizer.apply_chat_template(
                head + [{"role": "user", "content": parts}],
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=True,
            )
            if not has_image or self.image_token in text:
                return text
        except Exception:  # a string-content template: fall through to the string form
            pass
        content = (f"{self.image_token}\n" if has_image else "") + question
        return self.tokenizer.apply_chat_template(
            head + [{"role": "user", "content": content}],
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def prompt(self, question: str, image: Any = None, system: Optional[str] = None) -> LlavaPrompt:
        """Render, tokenize and expand the image placeholder (`image`: a PIL image or None)."""
        ids = torch.tensor(
            self.tokenizer(self.render(question, image is not None, system), add_special_tokens=False)["input_ids"],
            dtype=torch.long,
        )
        where = (ids == self.cfg.image_token_id).nonzero().flatten()
        if image is None:
            if where.numel():
                raise GenerationError(f"the prompt holds {self.image_token} but no image was given")
            return LlavaPrompt(ids)
        if where.numel() != 1:
            raise GenerationError(f"the rendered prompt holds {where.numel()} image placeholders; one image was given")
        v = self.cfg.vision
        processed = anyres.process_image(
            anyres.to_rgb(image),
            self.cfg.max_tiles,
            image_size=v.image_size,
            patch_size=v.patch_size,
            grid_max=self.cfg.grid_max,
            **self.image_stats,
        )
        at = int(where[0])
        ids = torch.cat([ids[:at], torch.full((processed.num_tokens,), self.cfg.image_token_id), ids[at + 1 :]])
        return LlavaPrompt(ids, processed.pixel_values, processed.image_size)

    def embed(self, prompt: LlavaPrompt) -> torch.Tensor:
        """Decoder input [T, h]: token embeddings with the image features at the placeholders."""
        dev = self.placement.device
        ids = prompt.input_ids.to(dev)
        emb = self.llava.language_model.embedding(input_ids=ids[None], position_ids=None)[:, 0]
        if prompt.pixel_values is None:
            return emb
        batch = hf_inputs_to_batch(
            self.cfg, prompt.input_ids[None], prompt.pixel_values[None], torch.tensor([list(prompt.image_size)])
        )
        batch.pixel_values = batch.pixel_values.to(self.placement.dtype)
        media = self.llava.media_embeddings(batch.to(dev)).to(emb.dtype)
        emb = emb.clone()
        emb[ids == self.cfg.image_token_id] = media
        return emb

    # ------------------------------------------------------------------ requests and answers
    def request(self, prompt: LlavaPrompt, max_new_tokens: int, seed: int = 0) -> GenerationRequest:
        if len(prompt.input_ids) + max_new_tokens > self.cfg.llm.max_position_embeddings:
            raise GenerationError(
                f"the prompt ({len(prompt.input_ids)} tokens) plus {max_new_tokens} new tokens exceed "
                f"the model's {self.cfg.llm.max_position_embeddings} positions"
            )
        return GenerationRequest(
            prompt=prompt, max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=self.stop_token_ids
        )

    def answer(self, result: GenerationResult) -> str:
        tokens = result.tokens[:-1] if result.finish_reason == "stop_token" else result.tokens
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[LlavaPrompt],
        sampling: SamplingParams,
        *,
        max_new_tokens: int = 256,
        seed: int = 0,
        batch_size: int = 8,
        progress: Optional[Progress] = None,
    ) -> list[GenerationResult]:
        requests = [self.request(p, max_new_tokens, seed + i) for i, p in enumerate(prompts)]
        return generate(self.model, requests, sampling, batch_size=batch_size, progress=progress)
