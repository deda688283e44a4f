"""HF <-> megatron-core state-dict adapters for LLaVA-OV and SigLIP alone, and the HF config
mappings (LlavaOnevisionConfig, SiglipVisionConfig) they need.

Built from the shared machinery in `mmtrain.models.state_dict_adapter` (streaming triples,
qkv/gate-up layouts, the Llama-style decoder part). Layouts added here: SigLIP's patch conv +
position table, the projector's two linears, `image_newline`, and the HF on-disk name variants
of LLaVA-OV checkpoints.
"""

from __future__ import annotations

import re
from typing import Optional

from mmdata.energon_loaders.llava_ov import anyres
from mmtrain.llava_ov.config import LlavaOVModelConfig, VisionConfig
from mmtrain.models.state_dict_adapter import (
    ConversionError,
    LlamaDecoderAdapter,
    Pair,
    StateDictAdapter,
    check_hf_model,
    hf_decoder_keys,
    llm_config_from_hf,
)


class SiglipAdapter:
    """SigLIP vision tower; `hf_prefix` is where `embeddings.` / `encoder.` live."""

    def __init__(self, cfg: VisionConfig, hf_prefix: str, mc_prefix: str = "") -> None:
        self.cfg, self.hp, self.mp = cfg, hf_prefix, mc_prefix

    def pairs(self) -> list[Pair]:
        h, m = self.hp, self.mp
        out = [
            (m + "conv1.weight", [h + "embeddings.patch_embedding.weight"], "copy"),
            (m + "conv1.bias", [h + "embeddings.patch_embedding.bias"], "copy"),
            (m + "position_embeddings.weight", [h + "embeddings.position_embedding.weight"], "copy"),
        ]
        for i in range(self.cfg.num_layers):
            hl, ml = f"{h}encoder.layers.{i}.", f"{m}decoder.layers.{i}."
            a = hl + "self_attn."
            for kind in ("weight", "bias"):
                out += [
                    (ml + f"input_layernorm.{kind}", [hl + f"layer_norm1.{kind}"], "copy"),
                    (
                        ml + f"self_attention.linear_qkv.{kind}",
                        [a + f"q_proj.{kind}", a + f"k_proj.{kind}", a + f"v_proj.{kind}"],
                        "qkv",
                    ),
                    (ml + f"self_attention.linear_proj.{kind}", [a + f"out_proj.{kind}"], "copy"),
                    (ml + f"pre_mlp_layernorm.{kind}", [hl + f"layer_norm2.{kind}"], "copy"),
                    (ml + f"mlp.linear_fc1.{kind}", [hl + f"mlp.fc1.{kind}"], "copy"),
                    (ml + f"mlp.linear_fc2.{kind}", [hl + f"mlp.fc2.{kind}"], "copy"),
                ]
        out += [
            (m + "ln_post.weight", [h + "post_layernorm.weight"], "copy"),
            (m + "ln_post.bias", [h + "post_layernorm.bias"], "copy"),
        ]
        return out

    def groups(self) -> tuple[int, int]:
        return self.cfg.num_attention_heads, self.cfg.num_attention_heads


# ----------------------------------------------------------------------------- whole-model adapters


#: HF on-disk name variants (hub checkpoints, transformers 4.x/5.x) -> the names written here
_HF_ALIASES = [
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^model\.vision_tower\."), "vision_tower."),
    (re.compile(r"^model\.multi_modal_projector\."), "multi_modal_projector."),
    (re.compile(r"^model\.image_newline$"), "image_newline"),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
]


def normalize_llava_hf_key(key: str) -> str:
    for pattern, repl in _HF_ALIASES:
        key = pattern.sub(repl, key)
    return key


class LlavaOVStateDictAdapter(StateDictAdapter):
    """Whole LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`) <-> `LlavaOVModel`."""

    ignorable = re.compile(r"^language_model\.lm_head\.weight$|^vision_tower\.head\.")

    def __init__(self, cfg: LlavaOVModelConfig, transformer_impl: str = "local") -> None:
        super().__init__()
        self.cfg = cfg
        self._add(SiglipAdapter(cfg.vision, "vision_tower.", "vision_model."))
        self._pairs += [
            ("vision_projection.encoder.linear_fc1.weight", ["multi_modal_projector.linear_1.weight"], "copy"),
            ("vision_projection.encoder.linear_fc2.weight", ["multi_modal_projector.linear_2.weight"], "copy"),
        ]
        if cfg.projector.bias:
            self._pairs += [
                ("vision_projection.encoder.linear_fc1.bias", ["multi_modal_projector.linear_1.bias"], "copy"),
                ("vision_projection.encoder.linear_fc2.bias", ["multi_modal_projector.linear_2.bias"], "copy"),
            ]
        self._pairs.append(("image_newline", ["image_newline"], "copy"))
        self._add(
            LlamaDecoderAdapter(
                cfg.llm, "language_model.model.", "language_model.lm_head.weight", "language_model.", transformer_impl
            )
        )
        if not cfg.llm.tie_word_embeddings:
            self.ignorable = re.compile(r"^vision_tower\.head\.")

    def normalize_hf_key(self, key: str) -> str:
        return normalize_llava_hf_key(key)


class SiglipStateDictAdapter(StateDictAdapter):
    """`SiglipVisionModel` / the vision half of `SiglipModel` <-> `SiglipVisionModel` (megatron).

    Layers beyond `cfg.num_layers` (LLaVA-OV drops SigLIP's last layer), the pooling head and a
    text tower are ignored on the way in."""

    def __init__(self, cfg: VisionConfig, mc_prefix: str = "", source_layers: Optional[int] = None) -> None:
        super().__init__()
        self._add(SiglipAdapter(cfg, "vision_model.", mc_prefix))
        extra = ""
        if source_layers is not None and source_layers > cfg.num_layers:
            dropped = "|".join(str(i) for i in range(cfg.num_layers, source_layers))
            extra = rf"|^vision_model\.encoder\.layers\.({dropped})\."
        self.ignorable = re.compile(r"^vision_model\.head\.|^text_model\.|^logit_(scale|bias)$" + extra)

    def normalize_hf_key(self, key: str) -> str:
        return re.sub(
            r"^(model\.)?(vision_model\.)?(?=(embeddings|encoder|post_layernorm|head)\.)", "vision_model.", key
        )


# ----------------------------------------------------------------------------- configs


def vision_config_from_hf(vis: dict, num_layers: Optional[int] = None, where: str = "vision_config") -> VisionConfig:
    mt = vis.get("model_type", "siglip_vision_model")
    if mt not in ("siglip_vision_model", "siglip"):
        raise ConversionError(f"{where}.model_type={mt!r}: only SigLIP vision towers are supported")
    if vis.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConversionError(f"{where}.hidden_act={vis.get('hidden_act')!r}: expected gelu_pytorch_tanh")
    return VisionConfig(
        num_layers=int(num_layers if num_layers is not None else vis["num_hidden_layers"]),
        hidden_size=int(vis["hidden_size"]),
        ffn_hidden_size=int(vis["intermediate_size"]),
        num_attention_heads=int(vis["num_attention_heads"]),
        image_size=int(vis["image_size"]),
        patch_size=int(vis["patch_size"]),
        layer_norm_eps=float(vis.get("layer_norm_eps", 1e-6)),
        num_channels=int(vis.get("num_channels", 3)),
    )


def llava_config_from_hf(hf: dict) -> LlavaOVModelConfig:
    """`LlavaOnevisionConfig` (config.json dict) -> LlavaOVModelConfig; refuses what we don't model."""
    check_hf_model(hf, "llava_onevision", "LlavaOnevisionForConditionalGeneration")
    if hf.get("vision_feature_select_strategy", "full") != "full":
        raise ConversionError("config.json: vision_feature_select_strategy must be 'full'")
    if hf.get("vision_feature_layer", -1) != -1:
        raise ConversionError(
            f"config.json: vision_feature_layer={hf.get('vision_feature_layer')} (only -1 is supported)"
        )
    m = re.fullmatch(r"anyres_max_(\d+)", hf.get("vision_aspect_ratio", "anyres_max_9"))
    if not m:
        raise ConversionError(f"config.json: vision_aspect_ratio={hf.get('vision_aspect_ratio')!r}")
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise ConversionError(f"config.json: projector_hidden_act={hf.get('projector_hidden_act')!r}: expected gelu")
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    vision = vision_config_from_hf(hf["vision_config"])
    pins = [tuple(p) for p in hf.get("image_grid_pinpoints", [])]
    grid_max = int(round(len(pins) ** 0.5)) if pins else 6
    if pins and pins != [tuple(p) for p in anyres.grid_pinpoints(vision.image_size, grid_max)]:
        raise ConversionError(
            "config.json: image_grid_pinpoints is not the (1..N)x(1..N)x image_size square grid this model lays out"
        )

    cfg = LlavaOVModelConfig(
        llm=llm_config_from_hf(text),
        vision=vision,
        image_token_id=int(hf.get("image_token_id", hf.get("image_token_index", 151646))),
        video_token_id=int(hf.get("video_token_id", hf.get("video_token_index", 151647))),
        max_tiles=int(m.group(1)),
        grid_max=grid_max,
    )
    cfg.projector.bias = bool(hf.get("multimodal_projector_bias", True))
    return cfg


def hf_siglip_keys(v: VisionConfig, num_layers: int) -> dict:
    """A SigLIP vision config's keys for the tower `v` with `num_layers` layers (LLaVA-NeXT's
    checkpoints keep one layer more than the tower runs)."""
    return dict(
        model_type="siglip_vision_model",
        hidden_size=v.hidden_size,
        intermediate_size=v.ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=v.num_attention_heads,
        image_size=v.image_size,
        patch_size=v.patch_size,
        layer_norm_eps=v.layer_norm_eps,
        num_channels=v.num_channels,
        hidden_act="gelu_pytorch_tanh",
    )


def hf_config_from_llava(cfg: LlavaOVModelConfig, template: Optional[dict] = None) -> dict:
    """LlavaOVModelConfig -> a `LlavaOnevisionConfig` dict (on top of `template` when known)."""
    out = dict(template or {})
    text = dict(out.get("text_config") or {})
    llm = cfg.llm
    text.update(
        model_type="qwen2",
        **hf_decoder_keys(llm),
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta},
    )
    text.pop("rope_theta", None)
    vis = dict(out.get("vision_config") or {})
    v = cfg.vision
    vis.update(hf_siglip_keys(v, v.num_layers), vision_use_head=False)
    out.update(
        model_type="llava_onevision",
        architectures=["LlavaOnevisionForConditionalGeneration"],
        text_config=text,
        vision_config=vis,
        image_token_index=cfg.image_token_id,
        video_token_index=cfg.video_token_id,
        vision_aspect_ratio=f"anyres_max_{cfg.max_tiles}",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        multimodal_projector_bias=cfg.projector.bias,
        tie_word_embeddings=llm.tie_word_embeddings,
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(v.image_size, cfg.grid_max)],
    )
    return out
