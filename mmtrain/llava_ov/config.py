"""LLaVA-OneVision recipe sections: `model:` (LlavaOVModelConfig) and `data:` (LlavaOVDataConfig),
plus the cross-checks between them.

Field names follow the architecture, not any one library; `state_dict_adapter` maps them to and
from the HF configs (Qwen2Config, SiglipVisionConfig, LlavaOnevisionConfig). Plain dataclasses
with no torch/megatron import: the recipe validator and the CLI read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from mmtrain.config.schema import DataConfig
from mmtrain.models.lm_config import LLMConfig, padded_vocab_size

if TYPE_CHECKING:
    from mmtrain.config.errors import RecipeErrors
    from mmtrain.config.schema import Recipe


@dataclass
class VisionConfig:
    """SigLIP vision tower (LLaVA-OV keeps `num_layers` of the checkpoint's layers)."""

    num_layers: int = 26  # so400m has 27; LLaVA-OV drops the last one
    hidden_size: int = 1152
    ffn_hidden_size: int = 4304
    num_attention_heads: int = 16
    image_size: int = 384
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        # a stride-`patch` conv over `image_size` px reads floor(image_size / patch) patches
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2


@dataclass
class ProjectorConfig:
    type: str = "mlp2x_gelu"  # Linear(vision -> llm) + GELU + Linear(llm -> llm)
    bias: bool = True
    activation: str = "gelu"  # exact (erf) GELU, as HF's projector_hidden_act="gelu"


@dataclass
class LlavaOVModelConfig:
    """The recipe's `model:` section for `family: llava-ov`."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    #: the tokenizer's `<image>` / `<video>` ids; null (the default): read from `tokenizer.path`
    #: before the run starts (added to a tokenizer that lacks them); a pinned id must match it
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None
    max_tiles: int = 9  # anyres_max_9
    grid_max: int = 6  # pinpoints (1..grid_max) x (1..grid_max) x image_size
    make_vocab_size_divisible_by: int = 64  # also multiplied by TP when padding
    params_dtype: str = "float32"  # float32 | bfloat16 | float16

    def padded_vocab_size(self, tp: int = 1) -> int:
        return padded_vocab_size(self.llm.vocab_size, self.make_vocab_size_divisible_by, tp)


#: `model:` keys that decide the weights' shapes and meaning: a checkpoint whose saved model
#: config differs in one of them is refused (dtype, max_tiles ... may change between runs)
ARCHITECTURE_KEYS = ("llm", "vision", "projector", "image_token_id", "video_token_id")


@dataclass
class LlavaOVDataConfig(DataConfig):
    """The recipe's `data:` section for `family: llava-ov`: the shared loader keys plus how the
    LLaVA-OV task encoder lays out media."""

    max_tiles: int = 9  # anyres_max_N used when tiling images; must equal model.max_tiles
    video_frames: int = 8  # frames sampled per video


def check_recipe(recipe: Recipe, errors: RecipeErrors) -> None:
    """Cross-checks over the LLaVA-OV sections (run after the shared ones)."""
    d, m = recipe.data, recipe.model
    for key in ("max_tiles", "video_frames"):
        if getattr(d, key) <= 0:
            errors.add(("data", key), f"must be > 0, got {getattr(d, key)}")
    if m.max_tiles != d.max_tiles:
        errors.add(
            ("data", "max_tiles"),
            f"{d.max_tiles} differs from model.max_tiles={m.max_tiles}; "
            "the loader and the model must lay out the same tiles",
            [("model", "max_tiles")],
        )
