"""The batch contract between the energon loaders and the models (LLaVA-OV).

Conventions (shared with `mmtrain.llava_ov`):
- `input_ids` already has every image/video expanded: an image occupies exactly
  `num_tokens` consecutive positions holding `image_token_id` (same as what
  `transformers.LlavaOnevisionProcessor` produces), a video `num_tokens` positions of
  `video_token_id`.
- `labels` are ALREADY SHIFTED (Megatron convention): `labels[b, t]` is the target for the
  prediction made at position t, i.e. the token at t+1 of the same packed sample; -100 where
  no loss applies (system/user turns, image tokens, the last position of each sample, padding).
- Packing: each row holds one or more samples back to back, then padding. `position_ids`
  restart at 0 for each sample. `cu_seqlens` are cumulative lengths over the flattened
  `[B*S]` token stream (THD layout), one segment per sample and one per padding run, so
  attention can be restricted to within a segment.
- Media are flattened over the whole batch in the order they appear in the token stream.
  `pixel_values` stacks all tiles/frames; `tiles_per_media[i]` tiles belong to media i.
  MEDIA_ANYRES: tile 0 is the base image, then grid_shapes[i] = (rows, cols) tiles row-major;
  MEDIA_BASE_ONLY: 1 tile; MEDIA_VIDEO: one tile per sampled frame. `num_media_tokens[i]` equals
  `mmdata.energon_loaders.anyres` counts (num_image_tokens / num_base_only_tokens /
  num_video_tokens), the same numbers HF's LlavaOnevisionProcessor expands to.
- Loss: on assistant content and the assistant's closing `<|im_end|>` only (chat_template.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100

# media_kind values
MEDIA_ANYRES = 0  # single image: base tile + anyres grid
MEDIA_BASE_ONLY = 1  # one tile per image (multi-image samples)
MEDIA_VIDEO = 2  # sampled frames, pooled per frame


@dataclass
class LlavaOVBatch:
    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, shifted, IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # [B, S] int64, restart per packed sample
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 over the flattened B*S stream
    max_seqlen: int
    pixel_values: torch.Tensor  # [total_tiles, 3, H, W] float32 (SigLIP-normalised)
    tiles_per_media: torch.Tensor  # [num_media] int64
    media_kind: torch.Tensor  # [num_media] int64 (MEDIA_*)
    image_sizes: torch.Tensor  # [num_media, 2] int64 original (height, width)
    grid_shapes: torch.Tensor  # [num_media, 2] int64 anyres grid (rows, cols); (0, 0) if none
    num_media_tokens: torch.Tensor  # [num_media] int64 LLM positions each media expands to
    sample_ids: list[list[str]] = field(default_factory=list)  # per row, the packed sample ids
    num_loss_tokens: int = 0  # number of labels != IGNORE_INDEX
    sample_keys: list[list[str]] = field(default_factory=list)  # per row, the shard keys (unique)
    num_real_tokens: int = 0  # non-padding positions (packing efficiency = this / B*S)
    #: per-worker counters since that worker's previous batch ("skipped/<reason>", "truncated");
    #: the loader sums them into its `stats`
    stats: dict[str, int] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "LlavaOVBatch":
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return LlavaOVBatch(**moved)
