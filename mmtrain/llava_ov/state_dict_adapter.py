"""HF <-> megatron-core state-dict adapters for LLaVA-OV, Qwen2/2.5 alone and SigLIP alone.

Both sides are seen as *canonical full tensors*: HF names as transformers writes them to disk,
and megatron names at TP=1 with global layer numbers (`mmtrain.llava_ov.model_io` shards them
for TP/PP and renumbers layers per stage). Each direction is a generator yielding one tensor at a
time and pulling its 1-3 source tensors on demand, so conversions stream.

Layouts handled here:
- QKV: HF q/k/v (+ biases) -> megatron `linear_qkv` in its per-query-group interleaved layout
  [g0: q(heads/groups) k v | g1: ...] (GQA for Qwen2, one group per head for SigLIP);
- SwiGLU: HF gate/up -> megatron `linear_fc1` = [gate; up];
- tied embeddings (no lm_head / output_layer), optional untied output layer;
- SigLIP patch conv + position table, the projector's two linears, `image_newline`.
Vocab padding to a TP multiple is applied when a tensor is placed into a model (model_io).
"""

from __future__ import annotations

import re
from typing import Callable, Iterator, Optional

import torch

from mmtrain.llava_ov.config import LLMConfig, LlavaOVModelConfig, VisionConfig

Getter = Callable[[str], torch.Tensor]


class ConversionError(ValueError):
    """A checkpoint does not fit the model: the message names the tensor or config key."""


# ----------------------------------------------------------------------------- qkv / gate-up layouts


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    hn = q.shape[0] // heads
    rest = q.shape[1:]
    qg = q.reshape(groups, (heads // groups) * hn, *rest)
    kg = k.reshape(groups, hn, *rest)
    vg = v.reshape(groups, hn, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = heads // groups + 2
    hn = qkv.shape[0] // (groups * per_group)
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, per_group * hn, *rest)
    q_len = (heads // groups) * hn
    q = g[:, :q_len].reshape(-1, *rest).contiguous()
    k = g[:, q_len : q_len + hn].reshape(-1, *rest).contiguous()
    v = g[:, q_len + hn :].reshape(-1, *rest).contiguous()
    return q, k, v


# ----------------------------------------------------------------------------- per-part adapters


class Qwen2Adapter:
    """Qwen2/2.5 decoder. `hf_prefix` is where `layers.N...` live (e.g. "model." or
    "language_model.model."), `lm_head` the untied output weight's name."""

    def __init__(self, cfg: LLMConfig, hf_prefix: str, lm_head: str, mc_prefix: str = "") -> None:
        self.cfg, self.hp, self.lm_head, self.mp = cfg, hf_prefix, lm_head, mc_prefix

    def _layer_pairs(self, i: int) -> list[tuple[str, list[str], str]]:
        h, m = f"{self.hp}layers.{i}.", f"{self.mp}decoder.layers.{i}."
        a = h + "self_attn."
        out = [
            (m + "input_layernorm.weight", [h + "input_layernorm.weight"], "copy"),
            (m + "self_attention.linear_qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], "qkv"),
            (m + "self_attention.linear_proj.weight", [a + "o_proj.weight"], "copy"),
            (m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], "copy"),
            (m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], "cat"),
            (m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"], "copy"),
        ]
        if self.cfg.qkv_bias:
            out.append((m + "self_attention.linear_qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], "qkv"))
        return out

    def pairs(self) -> list[tuple[str, list[str], str]]:
        out = [(f"{self.mp}embedding.word_embeddings.weight", [f"{self.hp}embed_tokens.weight"], "copy")]
        for i in range(self.cfg.num_layers):
            out += self._layer_pairs(i)
        out.append((f"{self.mp}decoder.final_layernorm.weight", [f"{self.hp}norm.weight"], "copy"))
        if not self.cfg.tie_word_embeddings:
            out.append((f"{self.mp}output_layer.weight", [self.lm_head], "copy"))
        return out

    def groups(self) -> tuple[int, int]:
        return self.cfg.num_attention_heads, self.cfg.num_query_groups


class SiglipAdapter:
    """SigLIP vision tower; `hf_prefix` is where `embeddings.` / `encoder.` live."""

    def __init__(self, cfg: VisionConfig, hf_prefix: str, mc_prefix: str = "") -> None:
        self.cfg, self.hp, self.mp = cfg, hf_prefix, mc_prefix

    def pairs(self) -> list[tuple[str, list[str], str]]:
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
                    (ml + f"self_attention.linear_qkv.{kind}", [a + f"q_proj.{kind}", a + f"k_proj.{kind}", a + f"v_proj.{kind}"], "qkv"),
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


# ----------------------------------------------------------------------------- the composite adapter


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


class StateDictAdapter:
    """Base: a list of (megatron name, [hf names], op) triples and the two streaming directions."""

    #: HF tensors that are legitimately not part of the megatron model
    ignorable = re.compile(r"$^")

    def __init__(self) -> None:
        self._pairs: list[tuple[str, list[str], str]] = []
        self._groups: dict[str, tuple[int, int]] = {}

    def _add(self, part: Qwen2Adapter | SiglipAdapter) -> None:
        for p in part.pairs():
            self._pairs.append(p)
            if p[2] == "qkv":
                self._groups[p[0]] = part.groups()

    def normalize_hf_key(self, key: str) -> str:
        return key

    def mcore_names(self) -> list[str]:
        return [m for m, _, _ in self._pairs]

    def hf_names(self) -> list[str]:
        return [h for _, hs, _ in self._pairs for h in hs]

    # HF -> megatron ---------------------------------------------------------------
    def mcore_tensor(self, name: str, get_hf: Getter) -> torch.Tensor:
        for m, hs, op in self._pairs:
            if m == name:
                return self._to_mcore(m, hs, op, get_hf)
        raise ConversionError(f"megatron tensor {name!r} has no HF counterpart in {type(self).__name__}")

    def _to_mcore(self, m: str, hs: list[str], op: str, get_hf: Getter) -> torch.Tensor:
        src = [get_hf(h) for h in hs]
        if op == "copy":
            return src[0]
        if op == "cat":
            if src[0].shape != src[1].shape:
                raise ConversionError(f"{hs[0]} {tuple(src[0].shape)} and {hs[1]} {tuple(src[1].shape)} differ in shape")
            return torch.cat(src, dim=0)
        heads, groups = self._groups[m]
        q, k, v = src
        if q.shape[0] % heads or k.shape[0] * heads != q.shape[0] * groups or v.shape != k.shape:
            raise ConversionError(
                f"{hs[0]} {tuple(q.shape)} / {hs[1]} {tuple(k.shape)} / {hs[2]} {tuple(v.shape)} do not fit "
                f"{heads} heads in {groups} query groups"
            )
        return fuse_qkv(q, k, v, heads, groups)

    def iter_mcore(self, get_hf: Getter) -> Iterator[tuple[str, torch.Tensor]]:
        for m, hs, op in self._pairs:
            yield m, self._to_mcore(m, hs, op, get_hf)

    # megatron -> HF ---------------------------------------------------------------
    def iter_hf(self, get_mcore: Getter) -> Iterator[tuple[str, torch.Tensor]]:
        for m, hs, op in self._pairs:
            t = get_mcore(m)
            if op == "copy":
                yield hs[0], t
            elif op == "cat":
                half = t.shape[0] // 2
                yield hs[0], t[:half].contiguous()
                yield hs[1], t[half:].contiguous()
            else:
                heads, groups = self._groups[m]
                for h, part in zip(hs, split_qkv(t, heads, groups)):
                    yield h, part

    def check_hf_keys(self, available: set[str]) -> None:
        """Every needed HF tensor present; every present tensor used or known-ignorable."""
        needed = set(self.hf_names())
        missing = sorted(needed - available)
        if missing:
            raise ConversionError(f"HF checkpoint is missing tensor(s): {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
        unused = sorted(k for k in available - needed if not self.ignorable.search(k))
        if unused:
            raise ConversionError(
                f"HF checkpoint has tensor(s) the {type(self).__name__} does not map (architecture/config mismatch?): "
                f"{unused[:10]}" + (" ..." if len(unused) > 10 else "")
            )


class LlavaOVStateDictAdapter(StateDictAdapter):
    """Whole LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`) <-> `LlavaOVModel`."""

    ignorable = re.compile(r"^language_model\.lm_head\.weight$|^vision_tower\.head\.")

    def __init__(self, cfg: LlavaOVModelConfig) -> None:
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
        self._add(Qwen2Adapter(cfg.llm, "language_model.model.", "language_model.lm_head.weight", "language_model."))
        if not cfg.llm.tie_word_embeddings:
            self.ignorable = re.compile(r"^vision_tower\.head\.")

    def normalize_hf_key(self, key: str) -> str:
        return normalize_llava_hf_key(key)


class Qwen2StateDictAdapter(StateDictAdapter):
    """`Qwen2ForCausalLM` <-> a megatron `GPTModel` (names relative to the GPTModel)."""

    ignorable = re.compile(r"^lm_head\.weight$")

    def __init__(self, cfg: LLMConfig, mc_prefix: str = "") -> None:
        super().__init__()
        self._add(Qwen2Adapter(cfg, "model.", "lm_head.weight", mc_prefix))
        if not cfg.tie_word_embeddings:
            self.ignorable = re.compile(r"$^")


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
        return re.sub(r"^(model\.)?(vision_model\.)?(?=(embeddings|encoder|post_layernorm|head)\.)", "vision_model.", key)


# ----------------------------------------------------------------------------- configs


def _rope_theta(text: dict) -> float:
    if "rope_theta" in text:
        return float(text["rope_theta"])
    rp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ConversionError(f"text_config.rope_parameters.rope_type={rp.get('rope_type')!r} is not supported (default RoPE only)")
    return float(rp.get("rope_theta", 10000.0))


def llm_config_from_hf(text: dict, where: str = "text_config") -> LLMConfig:
    mt = text.get("model_type", "qwen2")
    if mt not in ("qwen2",):
        raise ConversionError(f"{where}.model_type={mt!r}: only qwen2 (Qwen2/Qwen2.5) decoders are supported")
    if text.get("use_sliding_window"):
        raise ConversionError(f"{where}.use_sliding_window=true is not supported")
    if text.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where}.hidden_act={text.get('hidden_act')!r}: expected silu")
    heads = int(text["num_attention_heads"])
    return LLMConfig(
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        ffn_hidden_size=int(text["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(text.get("num_key_value_heads") or heads),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rope_theta=_rope_theta(text),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=True,
    )


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
    from mmdata.energon_loaders import anyres

    archs = hf.get("architectures") or ["LlavaOnevisionForConditionalGeneration"]
    if hf.get("model_type") != "llava_onevision" or "LlavaOnevisionForConditionalGeneration" not in archs:
        raise ConversionError(
            f"config.json: model_type={hf.get('model_type')!r} architectures={archs}: expected llava_onevision / "
            "LlavaOnevisionForConditionalGeneration"
        )
    if hf.get("vision_feature_select_strategy", "full") != "full":
        raise ConversionError("config.json: vision_feature_select_strategy must be 'full'")
    if hf.get("vision_feature_layer", -1) != -1:
        raise ConversionError(f"config.json: vision_feature_layer={hf.get('vision_feature_layer')} (only -1 is supported)")
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


def hf_config_from_llava(cfg: LlavaOVModelConfig, template: Optional[dict] = None) -> dict:
    """LlavaOVModelConfig -> a `LlavaOnevisionConfig` dict (on top of `template` when known)."""
    from mmdata.energon_loaders import anyres

    out = dict(template or {})
    text = dict(out.get("text_config") or {})
    llm = cfg.llm
    text.update(
        model_type="qwen2", hidden_size=llm.hidden_size, intermediate_size=llm.ffn_hidden_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_attention_heads,
        num_key_value_heads=llm.num_query_groups, vocab_size=llm.vocab_size,
        max_position_embeddings=llm.max_position_embeddings, rms_norm_eps=llm.rms_norm_eps,
        tie_word_embeddings=llm.tie_word_embeddings, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta},
    )
    text.pop("rope_theta", None)
    vis = dict(out.get("vision_config") or {})
    v = cfg.vision
    vis.update(
        model_type="siglip_vision_model", hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size,
        num_hidden_layers=v.num_layers, num_attention_heads=v.num_attention_heads, image_size=v.image_size,
        patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps, num_channels=v.num_channels,
        hidden_act="gelu_pytorch_tanh", vision_use_head=False,
    )
    out.update(
        model_type="llava_onevision", architectures=["LlavaOnevisionForConditionalGeneration"],
        text_config=text, vision_config=vis, image_token_index=cfg.image_token_id,
        video_token_index=cfg.video_token_id, vision_aspect_ratio=f"anyres_max_{cfg.max_tiles}",
        vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu",
        multimodal_projector_bias=cfg.projector.bias, tie_word_embeddings=llm.tie_word_embeddings,
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(v.image_size, cfg.grid_max)],
    )
    return out
