"""LLaVA-OneVision model configuration: plain nested dataclasses (the recipe's `model:` section).

Field names follow the architecture, not any one library; `state_dict_adapter` maps them to and
from the HF configs (Qwen2Config, SiglipVisionConfig, LlavaOnevisionConfig).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LLMConfig:
    """Qwen2 / Qwen2.5 decoder."""

    num_layers: int = 28
    hidden_size: int = 1536
    ffn_hidden_size: int = 8960
    num_attention_heads: int = 12
    num_query_groups: int = 2
    vocab_size: int = 151936  # true (HF) vocabulary size; padded in the model, see padded_vocab_size
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


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
    llm: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    image_token_id: int = 151646
    video_token_id: int = 151647
    max_tiles: int = 9  # anyres_max_9
    grid_max: int = 6  # pinpoints (1..grid_max) x (1..grid_max) x image_size
    make_vocab_size_divisible_by: int = 64  # also multiplied by TP when padding
    params_dtype: str = "float32"  # float32 | bfloat16 | float16

    # ------------------------------------------------------------------ helpers
    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron pads the embedding table so every TP rank holds an equal, aligned slice."""
        multiple = self.make_vocab_size_divisible_by * tp
        v = self.llm.vocab_size
        return ((v + multiple - 1) // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LlavaOVModelConfig":
        data = dict(data)
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise KeyError(f"model config: unknown keys {sorted(unknown)}")
        sub = {"llm": LLMConfig, "vision": VisionConfig, "projector": ProjectorConfig}
        for key, klass in sub.items():
            if key in data and isinstance(data[key], dict):
                bad = set(data[key]) - set(klass.__dataclass_fields__)
                if bad:
                    raise KeyError(f"model config: unknown keys {sorted(f'{key}.{b}' for b in bad)}")
                data[key] = klass(**data[key])
        return cls(**data)

    # ------------------------------------------------------------------ presets
    @classmethod
    def aquila_vl_2b(cls) -> "LlavaOVModelConfig":
        """Aquila-VL-2B: Qwen2.5-1.5B-Instruct + SigLIP-so400m-patch14-384 (26 of 27 layers)."""
        return cls()

    @classmethod
    def tiny(cls) -> "LlavaOVModelConfig":
        """CPU-sized twin with the same structure (GQA, qkv bias, tied embeddings, anyres)."""
        return cls(
            llm=LLMConfig(
                num_layers=2,
                hidden_size=64,
                ffn_hidden_size=128,
                num_attention_heads=4,
                num_query_groups=2,
                vocab_size=1000,
                max_position_embeddings=4096,
            ),
            vision=VisionConfig(
                num_layers=2,
                hidden_size=32,
                ffn_hidden_size=64,
                num_attention_heads=2,
                image_size=30,  # 30 % 14 != 0, like 384 % 14: exercises the floor
                patch_size=14,
            ),
            image_token_id=998,
            video_token_id=999,
            make_vocab_size_divisible_by=8,
        )
