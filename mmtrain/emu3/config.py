"""Emu3 recipe sections: `model:` (Emu3ModelConfig) and `data:` (Emu3DataConfig), plus their
cross-checks. Plain dataclasses with no torch/megatron import: the recipe validator and the CLI
read them. Field names follow the architecture; `state_dict_adapter` maps them to and from
transformers' `Emu3Config` / `Emu3TextConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmdata.energon_loaders.emu3.tasks import DEFAULT_SYSTEM_PROMPT, GENERATION, TASKS, UNDERSTANDING
from mmtrain.config.schema import DataConfig
from mmtrain.models.lm_config import LLMConfig, padded_vocab_size

if TYPE_CHECKING:
    from mmtrain.config.errors import RecipeErrors
    from mmtrain.config.schema import Recipe


def emu3_8b_llm() -> LLMConfig:
    """Emu3's decoder (BAAI/Emu3-Stage1, -Chat, -Gen): Llama-style 8B over text BPE + VQ codes."""
    return LLMConfig(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=184622,
        max_position_embeddings=131072,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=False,
    )


@dataclass
class Emu3ModelConfig:
    """The recipe's `model:` section for `family: emu3`."""

    llm: LLMConfig = field(default_factory=emu3_8b_llm)
    make_vocab_size_divisible_by: int = 128  # also multiplied by TP when padding
    params_dtype: str = "float32"  # float32 | bfloat16 | float16

    def padded_vocab_size(self, tp: int = 1) -> int:
        return padded_vocab_size(self.llm.vocab_size, self.make_vocab_size_divisible_by, tp)


#: `model:` keys that decide the weights' shapes and meaning
ARCHITECTURE_KEYS = ("llm",)


@dataclass
class Emu3DataConfig(DataConfig):
    """The recipe's `data:` section for `family: emu3`: the shared loader keys (over token shards
    from `mmdata tokenize-images`) plus the task mix."""

    # task -> weight: a record that can be a text-to-image sample (one image, one exchange) is a
    # generation sample with probability w_gen / (w_gen + w_und); others are understanding
    tasks: dict[str, float] = field(default_factory=lambda: {UNDERSTANDING: 1.0, GENERATION: 1.0})
    p_uncond: float = 0.05  # generation: caption replaced by uncond_prompt (CFG training)
    uncond_prompt: str = ""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT


def check_recipe(recipe: Recipe, errors: RecipeErrors) -> None:
    """Cross-checks over the Emu3 sections (run after the shared ones)."""
    d = recipe.data
    for name, weight in d.tasks.items():
        if name not in TASKS:
            errors.add(("data", "tasks", name), f"unknown task; known: {', '.join(TASKS)}")
        elif weight < 0:
            errors.add(("data", "tasks", name), f"must be >= 0, got {weight}")
    if not sum(w for w in d.tasks.values() if w > 0) > 0:
        errors.add(("data", "tasks"), f"needs a task with a positive weight, got {d.tasks}")
    if not 0.0 <= d.p_uncond <= 1.0:
        errors.add(("data", "p_uncond"), f"must be in [0, 1], got {d.p_uncond}")
    if recipe.model.make_vocab_size_divisible_by <= 0:
        errors.add(("model", "make_vocab_size_divisible_by"), "must be > 0")
