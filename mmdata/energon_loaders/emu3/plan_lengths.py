"""Exact Emu3 sample lengths for packing plans: what the length index of token shards records,
and how pack-plan (mmdata/packing/emu3.py) turns it into one length per sample.

An Emu3 sample's encoded length depends on its task (understanding, or caption -> image
generation, whose caption classifier-free guidance may drop) and on the text tokenizer and
prompts. So:

- `mmdata tokenize-images --tokenizer DIR` counts, with the task encoder's own rendering
  (tasks.py, the same calls `encode_sample` makes), each written sample's length as an
  understanding sample and as a generation sample (UNENCODABLE where the encoder would skip it),
  and the tokens of its first image's block, from which a dropped-caption sample is counted for
  any unconditional prompt (`sample_lengths`; the index: mmdata/vision_tokens/lengths.py);
- the plan draws each sample's variant (`draw_variants`: the encoder's `pick_task` rule and CFG
  drop, with the plan's seed) and records it per sample; in `packing: plan` the encoder takes
  the variant from the plan instead of drawing (plan_packing.PLAN_VARIANT), so the plan's
  lengths are the lengths the loader makes;
- the plan records what the lengths depend on (`Emu3PlanGeometry`: tokenizer, system and
  unconditional prompts, task weights and CFG rate), and training refuses a plan whose
  geometry is not the recipe's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmdata.energon_loaders.emu3.tasks import Emu3Tasks, generation_caption
from mmdata.energon_loaders.labels import IGNORE_INDEX
from mmdata.energon_loaders.sequence import ConversationError
from mmdata.packing.emu3_geometry import UNENCODABLE


def sample_lengths(
    tasks: Emu3Tasks, conversations: Sequence[dict], grids: Sequence[np.ndarray]
) -> tuple[int, int, int]:
    """(understanding tokens, generation tokens, first image block tokens) of one record, as
    `Emu3TaskEncoder.encode_sample` builds it before the over-length policy."""
    try:
        tokens = tasks.understanding(conversations, grids)
        understanding = len(tokens) if (tokens.labels != IGNORE_INDEX).any() else UNENCODABLE
    except ConversationError:
        understanding = UNENCODABLE
    caption = generation_caption(conversations, len(grids))
    generation, block = UNENCODABLE, 0
    if grids:
        try:
            block = len(tasks.image_block(grids[0]))
            generation = len(tasks.generation(caption, grids[0])) if caption is not None else UNENCODABLE
        except ConversationError:
            generation = UNENCODABLE
    return understanding, generation, block
