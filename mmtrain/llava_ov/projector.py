"""mlp2x_gelu projector: megatron `MultimodalProjector` (Linear -> GELU -> Linear, TP-sharded)."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.models.layer_specs import mlp_submodules


def projector_transformer_config(cfg: LlavaOVModelConfig, base: dict[str, Any]) -> TransformerConfig:
    if cfg.projector.type != "mlp2x_gelu":
        raise ValueError(f"model.projector.type: unsupported projector {cfg.projector.type!r} (mlp2x_gelu)")
    act = {"gelu": F.gelu}.get(cfg.projector.activation)
    if act is None:
        raise ValueError(f"model.projector.activation: unsupported {cfg.projector.activation!r}")
    return TransformerConfig(
        num_layers=1,
        hidden_size=cfg.llm.hidden_size,
        ffn_hidden_size=cfg.llm.hidden_size,
        num_attention_heads=base.get("tensor_model_parallel_size", 1),  # unused; megatron checks divisibility
        activation_func=act,
        gated_linear_unit=False,
        add_bias_linear=cfg.projector.bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **base,
    )


def build_projector(cfg: LlavaOVModelConfig, config: TransformerConfig) -> MultimodalProjector:
    return MultimodalProjector(config, mlp_submodules(), projector_type="mlp", input_size=cfg.vision.hidden_size)
