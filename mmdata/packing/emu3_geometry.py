"""The Emu3 side of a packing plan's geometry: what an Emu3 plan's lengths and variants depend on
(`Emu3PlanGeometry`), the length index columns of token shards and their metadata, and the draw
of each sample's variant. The lengths themselves are counted with the task encoder's own
rendering (energon_loaders/emu3/plan_lengths.py, the doc of the whole scheme) by `mmdata
tokenize-images`; planning needs only these, so it stays below the loaders.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mmdata.local_tokenizer import load_local_tokenizer

#: the Emu3 tasks and default system prompt (energon_loaders/emu3/tasks.py renders them)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
UNDERSTANDING = "understanding"
GENERATION = "generation"

UNENCODABLE = -1  # the task encoder skips the sample in that task
#: a plan's per-sample choice (its `variant` column), handed to the encoder as the subflavor
#: plan_packing.PLAN_VARIANT
UNDERSTAND, GENERATE, GENERATE_UNCOND = 0, 1, 2
VARIANTS = {UNDERSTAND: (UNDERSTANDING, False), GENERATE: (GENERATION, False), GENERATE_UNCOND: (GENERATION, True)}
KIND = "emu3"  # `length_index.kind` in a token manifest; `geometry.kind` in an Emu3 plan
LENGTH_COLUMNS = ("understanding_tokens", "generation_tokens", "image_block_tokens")
INDEX_META = b"mmdata.length_index"  # the length index's metadata key (vision_tokens/lengths.py writes it)


def index_meta(table) -> dict:
    """The `mmdata.length_index` metadata of a length index ({} for `mmdata preprocess`'s)."""
    raw = (table.schema.metadata or {}).get(INDEX_META)
    return json.loads(raw) if raw else {}


def uncond_prompt_tokens(tokenizer_path: str | Path, prompt: str) -> int:
    """Text tokens of the unconditional prompt that replaces a dropped caption (none for "", the
    default: Emu3Tasks.generation renders [bos] + prompt + block + [eos]), encoded as the task
    encoder encodes text (serialize.hf_text_encoder: no added specials)."""
    if not prompt:
        return 0
    return len(load_local_tokenizer(tokenizer_path, "tokenizer").encode(prompt, add_special_tokens=False))


@dataclass(frozen=True)
class Emu3PlanGeometry:
    """What an Emu3 plan's lengths and variants depend on besides the samples: the text
    tokenizer (sha256 of its folder), the prompts, the task weights and the CFG drop rate."""

    tokenizer_sha256: str
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    uncond_prompt: str = ""
    tasks: dict[str, float] = field(default_factory=lambda: {UNDERSTANDING: 1.0, GENERATION: 1.0})
    p_uncond: float = 0.05

    counts: ClassVar[str] = "Emu3 sample lengths (a task and caption drop drawn per sample)"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": KIND, **asdict(self), "tasks": {k: float(v) for k, v in sorted(self.tasks.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> Emu3PlanGeometry:
        return cls(
            d["tokenizer_sha256"], d["system_prompt"], d["uncond_prompt"], dict(d["tasks"]), float(d["p_uncond"])
        )

    def differences(self, want: Emu3PlanGeometry) -> list[str]:
        """`field plan X (recipe: Y)` for each setting that differs."""
        have_d, want_d = self.as_dict(), want.as_dict()
        return [f"{k} {_short(have_d[k])} (recipe: {_short(want_d[k])})" for k in have_d if have_d[k] != want_d[k]]

    def remedy(self, shards: Path, seq_length: int) -> str:
        return (
            f"run `mmtrain pack-plan RECIPE.yaml {shards} --set train.seq_length={seq_length}` (the recipe's "
            "tokenizer.path and data.tasks / p_uncond / uncond_prompt / system_prompt)"
        )


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def draw_variants(
    table, geometry: Emu3PlanGeometry, seed: int, uncond_tokens: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(variant, length) per length-index row; length UNENCODABLE where the encoder skips the
    sample in the drawn task. The task draw is `pick_task`'s rule (generation with probability
    w_gen / (w_gen + w_und) for a record that can be one, else understanding), then the CFG drop
    with `p_uncond` (the caption replaced by a prompt of `uncond_tokens` tokens), from a generator
    seeded with `seed`: a pure function of (the index, the settings, the seed)."""
    und, gen, block = (table.column(c).to_numpy().astype(np.int64) for c in LENGTH_COLUMNS)
    w_und, w_gen = float(geometry.tasks.get(UNDERSTANDING, 0.0)), float(geometry.tasks.get(GENERATION, 0.0))
    u = np.random.default_rng([seed, 0xE3]).random((len(und), 2))
    generate = (gen != UNENCODABLE) & (w_gen > 0) & (u[:, 0] * (w_und + w_gen) < w_gen)
    uncond = generate & (u[:, 1] < geometry.p_uncond)
    variant = np.where(generate, np.where(uncond, GENERATE_UNCOND, GENERATE), UNDERSTAND).astype(np.int8)
    length = np.where(uncond, 2 + uncond_tokens + block, np.where(generate, gen, und if w_und > 0 else UNENCODABLE))
    return variant, length


@dataclass(frozen=True)
class VariantChoices:
    """What each Emu3 sample may become, for a variant drawn anew each epoch (the global order):
    its length in each variant (columns UNDERSTAND, GENERATE, GENERATE_UNCOND; UNENCODABLE where
    the encoder skips it), which tasks it can take, and the draw's odds."""

    lengths: np.ndarray  # (N, 3) int32
    can_understand: np.ndarray  # bool: understanding has a positive weight and the sample encodes
    can_generate: np.ndarray  # bool: likewise for generation
    generate_share: float  # w_gen / (w_und + w_gen): pick_task's odds for a sample that can be both
    p_uncond: float

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, keep: np.ndarray) -> VariantChoices:
        return VariantChoices(
            self.lengths[keep], self.can_understand[keep], self.can_generate[keep], self.generate_share, self.p_uncond
        )

    def draw(self, u: np.ndarray, at: slice = slice(None)) -> np.ndarray:
        """The variant (int8) of the samples `at` from uniforms `u` (one row of two each):
        `pick_task`'s rule among the tasks the sample can take (one it cannot take is never drawn:
        no sample is skipped in one epoch and trained in another), then the caption drop."""
        can_und, can_gen = self.can_understand[at], self.can_generate[at]
        generate = can_gen & (~can_und | (u[:, 0] < self.generate_share))
        uncond = generate & (u[:, 1] < self.p_uncond)
        return np.where(generate, np.where(uncond, GENERATE_UNCOND, GENERATE), UNDERSTAND).astype(np.int8)

    def expected_lengths(self) -> np.ndarray:
        """Each sample's mean length over the draw (int64; estimates such as rows per epoch)."""
        both = self.can_understand & self.can_generate
        gen = np.where(both, self.generate_share, self.can_generate.astype(np.float64))
        mean = (1 - gen) * self.lengths[:, UNDERSTAND] + gen * (
            (1 - self.p_uncond) * self.lengths[:, GENERATE] + self.p_uncond * self.lengths[:, GENERATE_UNCOND]
        )
        return np.rint(mean).astype(np.int64)


def variant_choices(table, geometry: Emu3PlanGeometry, uncond_tokens: int = 0) -> VariantChoices:
    """The `VariantChoices` of every length-index row (a row that can take no task: neither)."""
    und, gen, block = (table.column(c).to_numpy().astype(np.int64) for c in LENGTH_COLUMNS)
    w_und, w_gen = float(geometry.tasks.get(UNDERSTANDING, 0.0)), float(geometry.tasks.get(GENERATION, 0.0))
    can_gen = (gen != UNENCODABLE) & (w_gen > 0)
    lengths = np.stack([und, gen, np.where(can_gen, 2 + uncond_tokens + block, UNENCODABLE)], axis=1)
    share = w_gen / (w_und + w_gen) if w_und + w_gen > 0 else 0.0
    return VariantChoices(
        lengths.astype(np.int32), (und != UNENCODABLE) & (w_und > 0), can_gen, share, geometry.p_uncond
    )


def variant_task(variant: int) -> tuple[str, bool]:
    """(task, caption dropped) of a plan variant."""
    return VARIANTS[int(variant)]
