"""What a plan's sample lengths were counted with besides the samples themselves, recorded in
the plan (`geometry`) so that training refuses a plan counted for another model.

The length index counts image tokens with LLaVA-OV's own geometry (729 tokens per 384-px tile);
a plan for another vision tower recounts them with its `PlanGeometry` (inputs.py). Emu3 token
shards record `Emu3PlanGeometry` instead (emu3_geometry.py: tokenizer,
prompts, task weights and CFG rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from mmdata.media_layout import anyres_math as anyres
from mmdata.media_layout.media import DEFAULT_MAX_FRAMES, media_tiles
from mmdata.packing.emu3_geometry import KIND as EMU3_KIND
from mmdata.packing.emu3_geometry import Emu3PlanGeometry

GEOMETRY_FIELDS = ("image_size", "patch_size", "max_tiles", "grid_max", "video_frames")


@dataclass(frozen=True)
class PlanGeometry:
    """What a sample's image tokens depend on besides its image sizes: the vision tower's tile
    and patch, the anyres tile budget and grid, the video frame limit (the loader's settings)."""

    image_size: int = anyres.DEFAULT_IMAGE_SIZE
    patch_size: int = anyres.DEFAULT_PATCH_SIZE
    max_tiles: int = anyres.DEFAULT_MAX_TILES
    grid_max: int = anyres.DEFAULT_GRID_MAX
    video_frames: int = DEFAULT_MAX_FRAMES

    counts: ClassVar[str] = "image tokens (LLaVA-OV image geometry)"  # what a plan made with it counted

    def as_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in GEOMETRY_FIELDS}

    def flags(self) -> str:
        """The pack-plan options that make a plan with this geometry."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.as_dict().items())

    def differences(self, want: PlanGeometry) -> list[str]:
        return geometry_differences(self, want)

    def remedy(self, shards: Path, seq_length: int) -> str:
        """The command that makes the plan a recipe with this geometry needs."""
        return (
            f"run `mmdata pack-plan {shards} --seq-length {seq_length} {self.flags()}` "
            "(or `mmtrain pack-plan RECIPE.yaml`)"
        )

    def media_tokens(self, record: dict) -> int:
        """LLM positions of a record's media, as the LLaVA-OV loader lays them out with this
        geometry (media_layout.media.media_tokens at the default one), from the validator's header sizes."""
        meta = record.get("meta") or {}
        sizes = meta.get("image_sizes") or []
        total = sum(
            anyres.image_layout(
                h,
                w,
                len(sizes) == 1,
                image_size=self.image_size,
                patch_size=self.patch_size,
                max_tiles=self.max_tiles,
                grid_max=self.grid_max,
            )[1]
            for w, h, _ in sizes
        )
        video = meta.get("video_size_frames")
        if video:
            total += anyres.num_video_tokens(min(int(video[2]), self.video_frames), self.image_size, self.patch_size)
        return total

    def media_tiles(self, record: dict) -> int:
        """Tiles and frames the vision tower encodes for a record with this geometry "
        "(media_layout.media.media_tiles)."""
        return media_tiles(record, image_size=self.image_size, grid_max=self.grid_max, video_frames=self.video_frames)


DEFAULT_GEOMETRY = PlanGeometry()


def plan_geometry(info: dict) -> PlanGeometry | Emu3PlanGeometry:
    """The geometry a plan recorded (its metadata's `geometry`)."""
    g = info["geometry"]
    if g.get("kind") == EMU3_KIND:
        return Emu3PlanGeometry.from_dict(g)
    return PlanGeometry(**{k: int(g[k]) for k in GEOMETRY_FIELDS})


def geometry_differences(have: PlanGeometry, want: PlanGeometry) -> list[str]:
    """`field plan X, recipe Y` for each field that differs."""
    return [
        f"{k} {getattr(have, k)} (recipe: {getattr(want, k)})"
        for k in GEOMETRY_FIELDS
        if getattr(have, k) != getattr(want, k)
    ]
