"""What a recipe's packing plans must have counted with, for `mmtrain pack-plan` to plan with and
the preflight to check a plan against (`plan_packing.plan_for_data`): the image token geometry
of a LLaVA-OV recipe (`model.vision` image_size / patch_size, `model.max_tiles`,
`model.grid_max`, `data.video_frames`, what its loader is built with), the task settings and
tokenizer of an Emu3 recipe (`data.tasks`, `p_uncond`, `uncond_prompt`, `system_prompt`,
`tokenizer.path`). A leaf: it imports nothing from mmtrain.
"""

from __future__ import annotations

from typing import Any

from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.media_layout.media import DEFAULT_MAX_FRAMES
from mmdata.packing.geometry import PlanGeometry
from mmdata.shard_job.lengths import tokenizer_fingerprint


def recipe_geometry(recipe: Any) -> PlanGeometry | Emu3PlanGeometry | None:
    """What a recipe's plans must have counted with (see the module docstring); None for a recipe
    with neither. FileNotFoundError: an Emu3 recipe without its tokenizer."""
    m, d = recipe.model, recipe.data
    if hasattr(d, "p_uncond"):  # Emu3's data section: its samples' lengths depend on the task settings
        path = recipe.tokenizer.path
        if path is None:
            raise FileNotFoundError("tokenizer.path is not set: an Emu3 plan is checked against its tokenizer")
        return Emu3PlanGeometry(
            tokenizer_fingerprint(path), d.system_prompt, d.uncond_prompt, dict(d.tasks), float(d.p_uncond)
        )
    vision = getattr(m, "vision", None)
    if vision is None or not hasattr(m, "max_tiles"):
        return None
    grid_max = getattr(m, "grid_max", PlanGeometry.grid_max)
    return PlanGeometry(
        vision.image_size, vision.patch_size, m.max_tiles, grid_max, getattr(d, "video_frames", DEFAULT_MAX_FRAMES)
    )
