"""SigLIP vision tower on megatron-core: conv patch embedding + learned positions + a megatron
`TransformerBlock` (bidirectional attention, tanh-GELU MLP, LayerNorm).

Why not `CLIPViTModel(model_subtype="siglip")`: it always applies `ln_post`, while LLaVA-OV
takes the last kept layer's output *before* the post-layernorm (HF `hidden_states[-1]`), and it
insists on `img % patch == 0` (384 % 14 != 0). A stride-`patch` conv reads floor(384/14)=27
patches exactly like HF, so no cropping is needed here. Parameter names follow CLIPViTModel
(`conv1`, `position_embeddings`, `decoder.layers.*`, `ln_post`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.llava_ov.config import VisionConfig
from mmtrain.models.layer_specs import transformer_layer_spec
from mmtrain.models.norm import TorchNorm


def vision_transformer_config(cfg: VisionConfig, base: dict[str, Any]) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        normalization="LayerNorm",
        layernorm_epsilon=cfg.layer_norm_eps,
        activation_func=functools.partial(F.gelu, approximate="tanh"),
        gated_linear_unit=False,
        add_bias_linear=True,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **base,
    )


class SiglipVisionModel(MegatronModule):
    def __init__(self, cfg: VisionConfig, config: TransformerConfig, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        self.cfg = cfg
        self.conv1 = torch.nn.Conv2d(
            cfg.num_channels,
            cfg.hidden_size,
            kernel_size=cfg.patch_size,
            stride=cfg.patch_size,
            bias=True,
            dtype=config.params_dtype,
        )
        self.position_embeddings = torch.nn.Embedding(cfg.num_patches, cfg.hidden_size, dtype=config.params_dtype)
        self.decoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec(causal=False),
            pre_process=True,
            post_process=False,
            pg_collection=pg_collection,
        )
        # kept for SigLIP-alone use and lossless HF round trips (transformers' LlavaOnevision
        # checkpoints hold `vision_tower.vision_model.post_layernorm.*`), but LLaVA-OV features
        # skip it: frozen, so it is loaded and exported unchanged and never sits in megatron's
        # grad buffer, where a parameter without a gradient fails the overlapped reduce.
        # `apply_freeze` only ever freezes, so no stage turns it back on.
        self.ln_post = TorchNorm(config, cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ln_post.requires_grad_(False)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, pixel_values: torch.Tensor, apply_post_layernorm: bool = False) -> torch.Tensor:
        """[n, 3, H, W] -> [n, patches, hidden] (the last kept layer's output)."""
        x = self.conv1(pixel_values.to(self.conv1.weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # [n, patches, hidden]
        if x.shape[1] != self.cfg.num_patches:
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} give {x.shape[1]} patches, "
                f"vision config expects {self.cfg.num_patches} ({self.cfg.image_size}px / {self.cfg.patch_size})"
            )
        x = x + self.position_embeddings.weight.unsqueeze(0)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        x = self.decoder(x, attention_mask=None)
        x = x.transpose(0, 1).contiguous()
        if apply_post_layernorm:
            x = self.ln_post(x)
        return x

    def one_patch_output(self) -> torch.Tensor:
        """[1, 1, hidden]: one zero patch through the conv, the first position and every layer.

        Why: a micro-batch (or a CP rank) without media still has to give each trainable tower
        parameter a gradient, or megatron DDP's overlapped grad reduce asserts; the
        model adds `0 * sum` of this (through the projector) to its embeddings. A sequence of
        one patch keeps that extra compute negligible."""
        p = self.cfg.patch_size
        x = self.conv1(self.conv1.weight.new_zeros(1, self.cfg.num_channels, p, p)).flatten(2).transpose(1, 2)
        x = x + self.position_embeddings.weight[:1].unsqueeze(0)
        x = self.decoder(x.transpose(0, 1).contiguous(), attention_mask=None)
        return x.transpose(0, 1).contiguous()
