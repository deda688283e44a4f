"""Plan inputs of Emu3 token shards (`mmdata tokenize-images --tokenizer`, whose length index
holds each sample's length per Emu3 task): each sample's task and caption drop are drawn here and
written to the plan (`variant`, with the samples' `key`s), the loader encodes each sample as its
variant says, and the geometry records the tokenizer, prompts, task weights and CFG rate
(emu3_geometry.py; counted by energon_loaders/emu3/plan_lengths.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from mmdata.errors import UserError
from mmdata.packing import emu3_geometry as e3
from mmdata.packing.geometry import PlanGeometry
from mmdata.packing.inputs import PlanInputs
from mmdata.shard_job.lengths import LENGTHS_NAME


def token_plan_inputs(
    root: Path,
    table: pa.Table,
    geometry: PlanGeometry | e3.Emu3PlanGeometry | None,
    tokenizer: str | Path | None,
    seed: int,
) -> PlanInputs:
    """Emu3 token shards: each sample's variant drawn and its length for it (emu3_geometry.py);
    samples the encoder would skip in their variant are left out (`skipped`). No vision tower
    encodes their images (they are tokens already): no tiles. `tokenizer` (the recipe's) counts
    the unconditional prompt; None: the geometry has none to count (no recipe, default settings)."""
    geometry = _checked_geometry(root, table, geometry)
    uncond = e3.uncond_prompt_tokens(tokenizer, geometry.uncond_prompt) if tokenizer is not None else 0
    variant, lengths = e3.draw_variants(table, geometry, seed, uncond)
    keep = lengths != e3.UNENCODABLE
    n = np.bincount(variant[keep], minlength=3)
    summary = (
        f"Emu3 tasks: {n[e3.UNDERSTAND]:,} understanding, {n[e3.GENERATE] + n[e3.GENERATE_UNCOND]:,} "
        f"generation ({n[e3.GENERATE_UNCOND]:,} caption dropped), {int((~keep).sum()):,} skipped"
    )
    return PlanInputs(
        lengths[keep],
        np.zeros(int(keep.sum()), np.int64),
        table.column("index").to_numpy()[keep],
        geometry,
        summary,
        {"skipped": int((~keep).sum())},
        {"key": table.column("key").filter(keep), "variant": variant[keep]},
    )


def token_variant_choices(
    root: Path, table: pa.Table, geometry: PlanGeometry | e3.Emu3PlanGeometry | None, tokenizer: str | Path | None
) -> tuple[np.ndarray, e3.VariantChoices]:
    """Emu3 token shards for a variant drawn per epoch (the global order): the rows that can take
    some task (a bool mask), and their `VariantChoices`; checked as `token_plan_inputs` checks."""
    geometry = _checked_geometry(root, table, geometry)
    uncond = e3.uncond_prompt_tokens(tokenizer, geometry.uncond_prompt) if tokenizer is not None else 0
    choices = e3.variant_choices(table, geometry, uncond)
    keep = choices.can_understand | choices.can_generate
    return keep, choices.take(keep)


def _checked_geometry(
    root: Path, table: pa.Table, geometry: PlanGeometry | e3.Emu3PlanGeometry | None
) -> e3.Emu3PlanGeometry:
    """The recipe's Emu3 geometry (the defaults without one), refused where the index disagrees."""
    have = e3.index_meta(table)
    if have.get("kind") != e3.KIND:
        raise UserError(f"{root}/{LENGTHS_NAME}: a length index of unknown kind {have.get('kind')!r}")
    if geometry is None:  # no recipe: the default task settings, with the index's tokenizer and prompt
        geometry = e3.Emu3PlanGeometry(have["tokenizer_sha256"], have["system_prompt"])
    elif not isinstance(geometry, e3.Emu3PlanGeometry):
        raise UserError(
            f"{root} holds Emu3 token shards: plan them with an emu3 recipe (`mmtrain pack-plan "
            "RECIPE.yaml`, or none); the image geometry options do not apply"
        )
    for name, what, flag in (
        ("tokenizer_sha256", "tokenizer", "--tokenizer (the recipe's tokenizer.path)"),
        ("system_prompt", "system prompt", "--system-prompt (the recipe's data.system_prompt)"),
    ):
        if getattr(geometry, name) != have[name]:
            raise UserError(
                f"{root}'s length index was counted with another {what} than the recipe's ({name} "
                f"{have[name]!r:.40}, recipe: {getattr(geometry, name)!r:.40}): rerun "
                f"`mmdata tokenize-images` with {flag}"
            )
    return geometry
