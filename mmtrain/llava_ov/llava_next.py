"""The LLaVA-NeXT checkpoint format (`LlavaQwenForCausalLM`, the original LLaVA-NeXT /
LLaVA-OneVision training code; Aquila-VL-2B and its stage checkpoints are stored this way):
its config mapping and its tensor names, in and out.

Layout (llava/model/language_model/llava_qwen.py, llava_arch.py, multimodal_encoder/
siglip_encoder.py, multimodal_projector/builder.py of LLaVA-VL/LLaVA-NeXT):
- one flat Qwen2 config with `mm_*` keys; no vision config (the tower is named by
  `mm_vision_tower`) and no media token ids (LLaVA-NeXT splices media at the id -200);
- `model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head` (absent when tied);
- `model.vision_tower.vision_tower.vision_model.*`: SigLIP with its last encoder layer deleted
  (LLaVA-NeXT drops it at load time, so `mm_vision_select_layer: -2` means "all stored layers");
- `model.mm_projector.{0,2}` (Linear, GELU, Linear) and `model.image_newline`.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from mmdata.energon_loaders.llava_ov import anyres
from mmtrain.llava_ov.config import LlavaOVModelConfig, VisionConfig
from mmtrain.llava_ov.state_dict_adapter import SiglipAdapter, hf_siglip_keys, vision_config_from_hf
from mmtrain.models.state_dict_adapter import (
    ConversionError,
    LlamaDecoderAdapter,
    StateDictAdapter,
    hf_decoder_keys,
    llm_config_from_hf,
)

log = logging.getLogger(__name__)

LLAVA_NEXT = "llava-next"
TRANSFORMERS = "transformers"
FORMATS = (TRANSFORMERS, LLAVA_NEXT)

ARCHITECTURE = "LlavaQwenForCausalLM"
MODEL_TYPE = "llava_qwen"
VISION_PREFIX = "model.vision_tower.vision_tower.vision_model."
DEFAULT_TOWER = "google/siglip-so400m-patch14-384"
#: published vision towers by `mm_vision_tower` name: LLaVA-NeXT configs carry only the name
KNOWN_TOWERS = {
    DEFAULT_TOWER: dict(
        model_type="siglip_vision_model",
        hidden_size=1152,
        intermediate_size=4304,
        num_attention_heads=16,
        num_hidden_layers=27,
        image_size=384,
        patch_size=14,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
    ),
}
_OTHER_LLAVA_ARCHS = (
    "LlavaLlamaForCausalLM",
    "LlavaMistralForCausalLM",
    "LlavaMixtralForCausalLM",
    "LlavaQwenMoeForCausalLM",
    "LlavaGemmaForCausalLM",
)


def detect_format(hf: dict, where: str = "config.json") -> str:
    """`llava-next` or `transformers`, from `architectures`, `model_type` and the `mm_*` keys."""
    archs = hf.get("architectures") or []
    if "LlavaOnevisionForConditionalGeneration" in archs or hf.get("model_type") == "llava_onevision":
        return TRANSFORMERS
    if (
        ARCHITECTURE in archs
        or any(a in archs for a in _OTHER_LLAVA_ARCHS)
        or hf.get("model_type") in (MODEL_TYPE, "llava")
        or any(k.startswith("mm_") for k in hf)
    ):
        return LLAVA_NEXT
    raise ConversionError(
        f"{where}: model_type={hf.get('model_type')!r} architectures={archs}: neither a transformers LLaVA-OneVision "
        f"checkpoint (LlavaOnevisionForConditionalGeneration) nor a LLaVA-NeXT one ({ARCHITECTURE}, mm_* keys)"
    )


# ----------------------------------------------------------------------------- config in


def parse_pinpoints(value, image_size: int, where: str) -> list[tuple[int, int]]:
    """`image_grid_pinpoints` as a list of [h, w] pixels or LLaVA-NeXT's `"(1x1),...,(6x6)"`
    string (tile counts, times the tower's image size)."""
    if isinstance(value, str) and "x" in value:
        found = re.findall(r"\((\d+)x(\d+)\)", value)
        if not found:
            raise ConversionError(f"{where}: image_grid_pinpoints={value!r}: expected '(1x1),...,(NxN)' or a list")
        (r0, c0), (r1, c1) = (tuple(map(int, found[0])), tuple(map(int, found[-1])))
        return [(i * image_size, j * image_size) for i in range(r0, r1 + 1) for j in range(c0, c1 + 1)]
    try:
        if isinstance(value, str):  # a list written as a string, as LLaVA-NeXT's train.py accepts
            value = ast.literal_eval(value)
        return [(int(h), int(w)) for h, w in value]
    except (TypeError, ValueError, SyntaxError):
        raise ConversionError(f"{where}: image_grid_pinpoints={value!r}: expected [[h, w], ...]") from None


def tower_config(hf: dict, hf_dir: Path, where: str) -> dict:
    """The SigLIP config of the whole published tower: `vision_config` (our exports write it), a
    local `mm_vision_tower` folder, or a known published tower by name."""
    if isinstance(hf.get("vision_config"), dict):
        return hf["vision_config"]
    name = hf.get("mm_vision_tower") or hf.get("vision_tower")
    if not name:
        raise ConversionError(f"{where}: no mm_vision_tower: cannot tell which vision tower the weights belong to")
    for folder in (Path(name), hf_dir / name):
        if (folder / "config.json").is_file():
            vis = json.loads((folder / "config.json").read_text())
            return vis["vision_config"] if vis.get("model_type") == "siglip" else vis
    if name in KNOWN_TOWERS:
        return KNOWN_TOWERS[name]
    raise ConversionError(
        f"{where}: mm_vision_tower={name!r} is neither a known tower ({', '.join(KNOWN_TOWERS)}) nor a local folder "
        "with a config.json; add its SigLIP config as `vision_config` to config.json"
    )


def stored_vision_layers(keys: set[str]) -> int:
    layers = {
        int(m.group(1)) for k in keys if (m := re.match(re.escape(VISION_PREFIX) + r"encoder\.layers\.(\d+)\.", k))
    }
    return max(layers) + 1 if layers else 0


def llava_next_config(
    hf: dict,
    hf_dir: Path,
    keys: set[str],
    image_token_id: int,
    video_token_id: int,
    vocab_size: int,
    where: str = "config.json",
) -> tuple[LlavaOVModelConfig, int]:
    """A LLaVA-NeXT config (dict) -> (LlavaOVModelConfig, vision layers stored in the weights);
    refuses by key what our model does not compute."""
    archs = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in archs:
        raise ConversionError(f"{where}: architectures={archs}: only {ARCHITECTURE} (a Qwen2 LLM) is supported")
    expect = {"mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch"}
    for key, want in expect.items():
        if hf.get(key, want) != want:
            raise ConversionError(f"{where}: {key}={hf[key]!r}: only {want!r} is supported")
    if "unpad" not in str(hf.get("mm_patch_merge_type", "spatial_unpad")):
        raise ConversionError(
            f"{where}: mm_patch_merge_type={hf['mm_patch_merge_type']!r}: only spatial_unpad "
            "(anyres tiles, unpadded, with image_newline) is supported"
        )
    if hf.get("mm_resampler_type"):
        raise ConversionError(f"{where}: mm_resampler_type={hf['mm_resampler_type']!r}: no resampler is supported")
    m = re.fullmatch(r"anyres_max_(\d+)", str(hf.get("image_aspect_ratio", "anyres_max_9")))
    if not m:
        raise ConversionError(
            f"{where}: image_aspect_ratio={hf.get('image_aspect_ratio')!r}: only anyres_max_N is supported"
        )
    for key, ours in (
        ("mm_spatial_pool_mode", "bilinear"),
        ("mm_newline_position", "one_token"),
        ("mm_spatial_pool_stride", 2),
        ("add_faster_video", False),
    ):
        if hf.get(key, ours) not in (ours, None):  # video only: images are laid out the same either way
            log.warning(
                "%s: %s=%r: videos are laid out with %s=%r here (one newline per video, bilinear 2x2 pooling)",
                where,
                key,
                hf[key],
                key,
                ours,
            )

    tower = tower_config(hf, hf_dir, where)
    tower_layers = int(tower["num_hidden_layers"])
    stored = stored_vision_layers(keys)
    used = tower_layers - 1  # mm_vision_select_layer -2: LLaVA-NeXT deletes the last layer
    if stored not in (used, tower_layers):
        raise ConversionError(
            f"{where}: the weights hold {stored} vision layer(s) under {VISION_PREFIX}encoder.layers; "
            f"the {tower_layers}-layer tower stores {used} (last dropped) or {tower_layers}"
        )
    vision: VisionConfig = vision_config_from_hf(tower, used, "vision tower config")
    if int(hf.get("mm_hidden_size", vision.hidden_size)) != vision.hidden_size:
        raise ConversionError(
            f"{where}: mm_hidden_size={hf['mm_hidden_size']} but the vision tower's hidden_size is {vision.hidden_size}"
        )
    pins = parse_pinpoints(hf.get("image_grid_pinpoints") or [], vision.image_size, where)
    grid_max = int(round(len(pins) ** 0.5)) if pins else 6
    if pins and set(pins) != set(anyres.grid_pinpoints(vision.image_size, grid_max)):
        raise ConversionError(
            f"{where}: image_grid_pinpoints is not the (1..N)x(1..N) x {vision.image_size}px "
            "square grid this model lays out"
        )
    text = {k: v for k, v in hf.items() if not k.startswith("mm_")} | {"model_type": "qwen2", "vocab_size": vocab_size}
    cfg = LlavaOVModelConfig(
        llm=llm_config_from_hf(text, "config"),
        vision=vision,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        max_tiles=int(m.group(1)),
        grid_max=grid_max,
    )
    cfg.projector.bias = True  # nn.Linear's default, always on in LLaVA-NeXT
    return cfg, stored


def apply_tokenizer_settings(tokenizer: Any, hf: dict, where: str = "config.json") -> None:
    """LLaVA-NeXT keeps its tokenizer's training settings in config.json (its train.py sets them
    on the tokenizer at load): `tokenizer_model_max_length` and `tokenizer_padding_side` go onto
    the resolved tokenizer, so the one kept with the conversion behaves as the source's did."""
    settings = {
        "model_max_length": hf.get("tokenizer_model_max_length"),
        "padding_side": hf.get("tokenizer_padding_side"),
    }
    settings = {k: v for k, v in settings.items() if v is not None}
    if settings.get("padding_side") not in (None, "left", "right"):
        raise ConversionError(f"{where}: tokenizer_padding_side={settings['padding_side']!r}: expected left or right")
    for key, value in settings.items():
        setattr(tokenizer, key, int(value) if key == "model_max_length" else value)
    if settings:
        log.info(
            "%s: tokenizer %s (from its tokenizer_* keys)", where, ", ".join(f"{k}={v!r}" for k, v in settings.items())
        )


# ----------------------------------------------------------------------------- config out


def llava_next_hf_config(cfg: LlavaOVModelConfig, template: Optional[dict] = None) -> dict:
    """LlavaOVModelConfig -> a LLaVA-NeXT config dict (over `template`, a LLaVA-NeXT source's)."""
    if not cfg.projector.bias:
        raise ConversionError("model.projector.bias=false: LLaVA-NeXT's mlp2x_gelu projector always has biases")
    llm, v = cfg.llm, cfg.vision
    out = dict(template or {})
    out.pop("vocab_size", None)
    tower = dict(KNOWN_TOWERS.get(out.get("mm_vision_tower", DEFAULT_TOWER), {}))
    tower.update(hf_siglip_keys(v, v.num_layers + 1))
    out.update(
        architectures=[ARCHITECTURE],
        model_type=out.get("model_type", MODEL_TYPE),
        **hf_decoder_keys(llm),
        rope_theta=llm.rope_theta,
        use_sliding_window=False,
        mm_vision_tower=out.get("mm_vision_tower", DEFAULT_TOWER),
        mm_hidden_size=v.hidden_size,
        mm_projector_type="mlp2x_gelu",
        mm_vision_select_layer=-2,
        mm_vision_select_feature="patch",
        mm_patch_merge_type="spatial_unpad",
        image_aspect_ratio=f"anyres_max_{cfg.max_tiles}",
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(v.image_size, cfg.grid_max)],
        mm_newline_position="one_token",
        mm_spatial_pool_mode="bilinear",
        use_mm_proj=True,
        mm_use_im_start_end=False,
        mm_use_im_patch_token=False,
        vision_config=tower,  # the whole tower (its last layer is not stored), as LLaVA-NeXT loads it
    )
    return out


# ----------------------------------------------------------------------------- tensors


class LlavaNextStateDictAdapter(StateDictAdapter):
    """LLaVA-NeXT `LlavaQwenForCausalLM` tensors <-> `LlavaOVModel`. On the way in, the vision
    tower's last layer (when stored), a pooling head, RoPE buffers and a tied `lm_head` are not
    imported, and each is named in the log."""

    def __init__(self, cfg: LlavaOVModelConfig, stored_vision_layers: Optional[int] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self._add(SiglipAdapter(cfg.vision, VISION_PREFIX, "vision_model."))
        for i, ours in ((0, "linear_fc1"), (2, "linear_fc2")):
            for kind in ("weight", "bias"):
                self._pairs.append(
                    (f"vision_projection.encoder.{ours}.{kind}", [f"model.mm_projector.{i}.{kind}"], "copy")
                )
        self._pairs.append(("image_newline", ["model.image_newline"], "copy"))
        self._add(LlamaDecoderAdapter(cfg.llm, "model.", "lm_head.weight", "language_model."))
        v = re.escape(VISION_PREFIX)
        skip = [v + r"head\.", r"\.rotary_emb\.inv_freq$"]
        if cfg.llm.tie_word_embeddings:
            skip.append(r"^lm_head\.weight$")
        if stored_vision_layers and stored_vision_layers > cfg.vision.num_layers:
            skip.append(
                v
                + r"encoder\.layers\.("
                + "|".join(map(str, range(cfg.vision.num_layers, stored_vision_layers)))
                + r")\."
            )
        self.ignorable = re.compile("|".join(skip))

    def check_hf_keys(self, available: set[str]) -> None:
        super().check_hf_keys(available)
        skipped = sorted(available - set(self.hf_names()))
        if skipped:
            log.info(
                "not imported (the model does not use them): %d tensor(s): %s%s",
                len(skipped),
                ", ".join(skipped[:8]),
                " ..." if len(skipped) > 8 else "",
            )
