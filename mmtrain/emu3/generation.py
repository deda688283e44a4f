"""Emu3 text-to-image on the shared generation engine (mmtrain/generation/): the prompt, the
image structure enforced while sampling, classifier-free guidance rows, VQ decoding.

A request for an (H, W)-code image is the prompt `[bos] caption [boi] "H*W" [img]`
(`serialize.generation_prompt`, = transformers' `Emu3Processor(return_for_image_generation=True)`)
and, with guidance, the same prompt around the negative caption as the unconditional row (the
Emu3 reference's negative prompt; an empty caption - what training's caption drop shows the
model - when none is given). The engine runs both rows in one batch and mixes their log-probs.

`ImageStructure` allows, at every step, only what keeps the output a decodable H x W grid: W
visual tokens then `eol`, H times, then `eof`, `eoi`, `eos` (the reference's prefix-constrained
decoding, `offset = generated + 1` counted from `[img]`). Generation therefore always ends after
exactly (W + 1) * H + 3 tokens with a full grid, whatever the weights or the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from transformers import AutoTokenizer

from mmdata.energon_loaders.emu3.serialize import Emu3Vocab, generation_prompt, hf_text_encoder
from mmdata.vision_tokens.vq import VQError, build_vq_model, load_image_processor, read_vq_checkpoint, spatial_factor
from mmtrain.emu3.load import load_emu3
from mmtrain.generation.checkpoint import CheckpointRef, GenerationError, Placement
from mmtrain.generation.engine import GenerationModel, GenerationRequest, GenerationResult, Progress, generate
from mmtrain.generation.sampling import SamplingParams

#: where a converted checkpoint keeps its VQ model (mmtrain.emu3.conversion)
KEPT_VQ = "vq"


@dataclass(frozen=True)
class ImagePrompt:
    """One image to generate; `height`/`width` in pixels (multiples of the VQ's spatial factor)."""

    text: str
    height: int = 512
    width: int = 512
    negative: str = ""
    #: 1 = no guidance (plain sampling), 0 = the negative prompt alone
    cfg_scale: float = 3.0
    seed: int = 0


@dataclass
class GeneratedImage:
    tokens: list[int]
    #: (rows, cols) VQ codes
    grid: np.ndarray
    #: PIL image (None when not decoded)
    image: object = None


class ImageStructure:
    """Emu3's image grammar as a logits processor for one request: log-probs [V] and the number of
    tokens generated so far -> the log-probs of the allowed tokens (the rest -inf)."""

    def __init__(self, rows: int, cols: int, vocab: Emu3Vocab, visual_mask: torch.Tensor) -> None:
        self.rows, self.cols, self.vocab, self.visual_mask = rows, cols, vocab, visual_mask

    @property
    def num_tokens(self) -> int:
        """Everything after `[img]`: rows of (cols visual + eol), then eof, eoi, eos."""
        return (self.cols + 1) * self.rows + 3

    def forced(self, step: int) -> Optional[int]:
        """The only allowed token at this step, or None where any visual token may come."""
        offset, body = step + 1, (self.cols + 1) * self.rows
        if offset <= body:
            return self.vocab.eol if offset % (self.cols + 1) == 0 else None
        v = self.vocab
        return {body + 1: v.eof, body + 2: v.eoi, body + 3: v.eos}.get(offset, v.pad)

    def __call__(self, scores: torch.Tensor, step: int) -> torch.Tensor:
        tok = self.forced(step)
        if tok is None:
            return scores.masked_fill(~self.visual_mask, float("-inf"))
        out = torch.full_like(scores, float("-inf"))
        out[tok] = scores[tok]
        return out


def grid_shape(height: int, width: int, factor: int) -> tuple[int, int]:
    """(rows, cols) of VQ codes of an image of height x width pixels."""
    if height <= 0 or width <= 0 or height % factor or width % factor:
        down = [max(factor, v // factor * factor) for v in (height, width)]
        up = [max(factor, -(-v // factor) * factor) for v in (height, width)]
        near = " or ".join(dict.fromkeys(f"--height {h} --width {w}" for h, w in (down, up)))
        raise GenerationError(
            f"image size {height}x{width}: height and width must be positive multiples of the "
            f"VQ's spatial factor {factor}; the nearest sizes that fit: {near}"
        )
    return height // factor, width // factor


def largest_fitting_grid(
    rows: int, cols: int, positions: Callable[[int, int], int], limit: int
) -> tuple[int, int] | None:
    """The largest (rows, cols) grid of about the aspect ratio of rows x cols whose generation needs
    at most `limit` positions (`positions(rows, cols)`), or None when not even one row fits."""
    for r in range(rows - 1, 0, -1):
        c = max(1, round(cols * r / rows))
        if positions(r, c) <= limit:
            return r, c
    return None


def grid_from_tokens(tokens: Sequence[int], rows: int, cols: int, vocab: Emu3Vocab) -> np.ndarray:
    """The (rows, cols) VQ codes of a generated image; ValueError when the tokens do not follow
    the structure (they always do when generated under `ImageStructure`)."""
    t = np.asarray(tokens, dtype=np.int64)
    body = (cols + 1) * rows
    if t.size != body + 3 or list(t[body:]) != [vocab.eof, vocab.eoi, vocab.eos]:
        raise ValueError(f"not a {rows}x{cols} Emu3 image: {t.size} tokens, ending {t[-3:].tolist()}")
    grid = t[:body].reshape(rows, cols + 1)
    if not (grid[:, cols] == vocab.eol).all():
        raise ValueError("a row does not end with eol")
    lookup = np.full(int(max(vocab.visual.max(), grid.max())) + 1, -1, dtype=np.int64)
    lookup[vocab.visual] = np.arange(vocab.codebook_size)
    codes = lookup[grid[:, :cols]]
    if (codes < 0).any():
        raise ValueError("a non-visual token inside the image")
    return codes


class VQDecoder:
    """Code grids -> PIL images with transformers' `Emu3VQVAE.decode` and
    `Emu3ImageProcessor.postprocess`, from a VQ-only dir or a whole HF Emu3 dir."""

    def __init__(self, vq_dir: str | Path, device: torch.device) -> None:
        try:
            ckpt = read_vq_checkpoint(vq_dir)
            self.processor = load_image_processor(vq_dir, None)
        except VQError as exc:
            raise GenerationError(f"VQ model: {exc}") from None
        self.factor = spatial_factor(ckpt.config)
        self.codebook_size = int(ckpt.config["codebook_size"])
        self.model = build_vq_model(ckpt, str(device))

    @torch.no_grad()
    def decode(self, grid: np.ndarray):
        codes = torch.as_tensor(grid, dtype=torch.long, device=next(self.model.parameters()).device)[None]
        pixels = self.model.decode(codes)[0].float().cpu()  # [3, H, W] in [-1, 1]
        return self.processor.postprocess([pixels], return_tensors="PIL.Image.Image")["pixel_values"][0]


class Emu3ImageGenerator:
    """A loaded Emu3 checkpoint with its tokenizer and VQ model: prompts -> images.

    The tokenizer and the VQ are checked before the decoder loads: a missing one is told at once."""

    def __init__(
        self, ref: CheckpointRef, placement: Placement, *, tokenizer_dir: Path, vq_dir: Path, decode_images: bool = True
    ) -> None:
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
            self.vocab = Emu3Vocab.from_tokenizer(self.tokenizer)
        except (OSError, ValueError) as exc:
            raise GenerationError(f"tokenizer {tokenizer_dir}: {exc}") from None
        self.vq = VQDecoder(vq_dir, placement.device) if decode_images else None
        if self.vq is not None and self.vq.codebook_size != self.vocab.codebook_size:
            raise GenerationError(
                f"the VQ model {vq_dir} has {self.vq.codebook_size} codes but the tokenizer "
                f"{self.vocab.codebook_size} visual tokens"
            )
        self.factor = self.vq.factor if self.vq is not None else 8
        inference = load_emu3(ref.path, ref.iteration)
        placement.apply(inference.model)
        self.config = inference.cfg
        if self.vocab.visual.max() >= self.config.llm.vocab_size:
            raise GenerationError(
                f"the tokenizer's visual tokens go up to id {int(self.vocab.visual.max())}, "
                f"beyond the model's {self.config.llm.vocab_size}-token vocabulary"
            )
        self.model = GenerationModel(decoder=inference.model.language_model, vocab_size=self.config.llm.vocab_size)
        self.visual_mask = torch.zeros(self.config.llm.vocab_size, dtype=torch.bool, device=placement.device)
        self.visual_mask[torch.as_tensor(self.vocab.visual)] = True
        self.encode_text = hf_text_encoder(self.tokenizer)

    def grid_shape(self, p: ImagePrompt) -> tuple[int, int]:
        return grid_shape(p.height, p.width, self.factor)

    def request(self, p: ImagePrompt) -> GenerationRequest:
        rows, cols = self.grid_shape(p)
        structure = ImageStructure(rows, cols, self.vocab, self.visual_mask)
        prompt = generation_prompt(p.text, rows, cols, self.vocab, self.encode_text)
        negative = generation_prompt(p.negative, rows, cols, self.vocab, self.encode_text)
        longest = max(len(prompt), len(negative)) + structure.num_tokens
        limit = self.config.llm.max_position_embeddings
        if longest > limit:
            raise GenerationError(
                f"image size {p.height}x{p.width} ({rows}x{cols} codes) needs {longest} positions, "
                f"the model has {limit}; {self._what_fits(p, rows, cols, limit)}"
            )
        return GenerationRequest(
            prompt=prompt,
            max_new_tokens=structure.num_tokens,
            negative_prompt=negative,
            guidance_scale=p.cfg_scale,
            seed=p.seed,
            stop_token_ids=(self.vocab.eos,),
            logits_processor=structure,
        )

    def _what_fits(self, p: ImagePrompt, rows: int, cols: int, limit: int) -> str:
        """The largest size of about the same aspect ratio that this prompt fits in, as options."""

        def positions(r: int, c: int) -> int:
            texts = (p.text, p.negative)
            return (
                max(len(generation_prompt(t, r, c, self.vocab, self.encode_text)) for t in texts)
                + ImageStructure(r, c, self.vocab, self.visual_mask).num_tokens
            )

        fit = largest_fitting_grid(rows, cols, positions, limit)
        if fit is None:
            return "not even one row of codes fits after this prompt: shorten the prompt"
        height, width = fit[0] * self.factor, fit[1] * self.factor
        return f"the largest size of this aspect ratio that fits: --height {height} --width {width}"

    def finish(self, prompts: Sequence[ImagePrompt], results: Sequence[GenerationResult]) -> list[GeneratedImage]:
        out = []
        for p, r in zip(prompts, results):
            grid = grid_from_tokens(r.tokens, *self.grid_shape(p), self.vocab)
            out.append(GeneratedImage(r.tokens, grid, self.vq.decode(grid) if self.vq is not None else None))
        return out

    def generate(
        self,
        prompts: Sequence[ImagePrompt],
        sampling: SamplingParams,
        *,
        batch_size: int = 8,
        progress: Optional[Progress] = None,
    ) -> list[GeneratedImage]:
        results = generate(
            self.model, [self.request(p) for p in prompts], sampling, batch_size=batch_size, progress=progress
        )
        return self.finish(prompts, results)
