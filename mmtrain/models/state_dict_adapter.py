"""HF <-> megatron-core state-dict adapters: the streaming machinery every family's adapter is
built from, and the Llama-style decoder part (Llama and the many HF models with its layout;
Qwen2/2.5 adds a qkv bias), with whole-model adapters for `LlamaForCausalLM` and `Qwen2ForCausalLM` and the HF
config mappings of such decoders.

Both sides are seen as *canonical full tensors*: HF names as transformers writes them to disk,
and megatron names at TP=1 with global layer numbers (`mmtrain.models.model_io` shards them for
TP/PP and renumbers layers per stage). Each direction is a generator yielding one tensor at a
time and pulling its 1-3 source tensors on demand, so conversions stream.

An adapter is a list of (megatron name, [HF names], op) triples, op one of
- "copy": one tensor as is;
- "cat": HF gate/up -> megatron SwiGLU `linear_fc1` = [gate; up];
- "qkv": HF q/k/v (+ biases) -> megatron `linear_qkv` in its per-query-group interleaved layout
  [g0: q(heads/groups) k v | g1: ...] (GQA for decoders, one group per head for ViT encoders).
Tied embeddings have no lm_head / output_layer; vocab padding to a TP multiple is applied when a
tensor is placed into a model (model_io).
"""

from __future__ import annotations

import re
from typing import Callable, Iterator, Protocol

import torch

from mmtrain.models.lm_config import LLMConfig

Getter = Callable[[str], torch.Tensor]
#: (megatron name, [HF names], op)
Pair = tuple[str, list[str], str]


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


# ----------------------------------------------------------------------------- part adapters


class PartAdapter(Protocol):
    """One tower of a model: its name pairs, and the (heads, query groups) of its qkv tensors."""

    def pairs(self) -> list[Pair]: ...

    def groups(self) -> tuple[int, int]: ...


#: a decoder layer's pre-norm weights: local spec name -> TE spec name (TE folds the norm into the
#: following linear: `TELayerNormColumnParallelLinear.layer_norm_weight`)
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
#: TE modules' `_extra_state` (fp8 metadata): no HF counterpart, ignored by the mapping
TE_EXTRA_STATE = re.compile(r"(^|\.)_extra_state$")


def _layer_re(decoder_prefix: str) -> re.Pattern:
    return re.compile(rf"^({re.escape(decoder_prefix)}decoder\.layers\.\d+\.)(.+)$")


def to_te_name(name: str, decoder_prefix: str = "") -> str:
    """A local-spec megatron name -> the TE-spec name (unchanged unless it is a decoder pre-norm)."""
    m = _layer_re(decoder_prefix).match(name)
    return m.group(1) + TE_NORM_NAMES[m.group(2)] if m and m.group(2) in TE_NORM_NAMES else name


def to_local_name(name: str, decoder_prefix: str = "") -> str:
    """A TE-spec megatron name -> the local-spec name (the inverse of `to_te_name`)."""
    back = {te: local for local, te in TE_NORM_NAMES.items()}
    m = _layer_re(decoder_prefix).match(name)
    return m.group(1) + back[m.group(2)] if m and m.group(2) in back else name


def is_te_extra_state(name: str) -> bool:
    return bool(TE_EXTRA_STATE.search(name))


class LlamaDecoderAdapter:
    """A Llama-style decoder (HF names as Llama and Qwen2/2.5 write them; the qkv bias only when
    `cfg.qkv_bias`, as Qwen2). `hf_prefix` is where `layers.N...` live (e.g. "model."
    or "language_model.model."), `lm_head` the untied output weight's name."""

    def __init__(
        self, cfg: LLMConfig, hf_prefix: str, lm_head: str, mc_prefix: str = "", transformer_impl: str = "local"
    ) -> None:
        self.cfg, self.hp, self.lm_head, self.mp = cfg, hf_prefix, lm_head, mc_prefix
        self.te = transformer_impl == "transformer_engine"  # megatron names of the TE decoder spec

    def _layer_pairs(self, i: int) -> list[Pair]:
        h, m = f"{self.hp}layers.{i}.", f"{self.mp}decoder.layers.{i}."
        a = h + "self_attn."
        out = [
            (m + "input_layernorm.weight", [h + "input_layernorm.weight"], "copy"),
            (
                m + "self_attention.linear_qkv.weight",
                [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                "qkv",
            ),
            (m + "self_attention.linear_proj.weight", [a + "o_proj.weight"], "copy"),
            (m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"], "copy"),
            (m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"], "cat"),
            (m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"], "copy"),
        ]
        if self.cfg.qkv_bias:
            out.append(
                (m + "self_attention.linear_qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], "qkv")
            )
        if self.te:
            out = [(to_te_name(n, self.mp), hs, op) for n, hs, op in out]
        return out

    def pairs(self) -> list[Pair]:
        out = [(f"{self.mp}embedding.word_embeddings.weight", [f"{self.hp}embed_tokens.weight"], "copy")]
        for i in range(self.cfg.num_layers):
            out += self._layer_pairs(i)
        out.append((f"{self.mp}decoder.final_layernorm.weight", [f"{self.hp}norm.weight"], "copy"))
        if not self.cfg.tie_word_embeddings:
            out.append((f"{self.mp}output_layer.weight", [self.lm_head], "copy"))
        return out

    def groups(self) -> tuple[int, int]:
        return self.cfg.num_attention_heads, self.cfg.num_query_groups


# ----------------------------------------------------------------------------- whole-model adapters


class StateDictAdapter:
    """Base: a list of (megatron name, [hf names], op) triples and the two streaming directions."""

    #: HF tensors that are legitimately not part of the megatron model
    ignorable = re.compile(r"$^")

    def __init__(self) -> None:
        self._pairs: list[Pair] = []
        self._groups: dict[str, tuple[int, int]] = {}

    def _add(self, part: PartAdapter) -> None:
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
        if is_te_extra_state(name):
            raise ConversionError(f"{name!r} is TE's _extra_state (no HF counterpart): skip it (is_te_extra_state)")
        raise ConversionError(f"megatron tensor {name!r} has no HF counterpart in {type(self).__name__}")

    def _to_mcore(self, m: str, hs: list[str], op: str, get_hf: Getter) -> torch.Tensor:
        src = [get_hf(h) for h in hs]
        if op == "copy":
            return src[0]
        if op == "cat":
            if src[0].shape != src[1].shape:
                raise ConversionError(
                    f"{hs[0]} {tuple(src[0].shape)} and {hs[1]} {tuple(src[1].shape)} differ in shape"
                )
            return torch.cat(src, dim=0)
        heads, groups = self._groups[m]
        q, k, v = src
        if q.shape[0] % heads or k.shape[0] * heads != q.shape[0] * groups or v.shape != k.shape:
            raise ConversionError(
                f"{hs[0]} {tuple(q.shape)} / {hs[1]} {tuple(k.shape)} / {hs[2]} {tuple(v.shape)} do not fit "
                f"{heads} heads in {groups} query groups"
            )
        return fuse_qkv(q, k, v, heads, groups)

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
            raise ConversionError(
                f"HF checkpoint is missing tensor(s): {missing[:10]}" + (" ..." if len(missing) > 10 else "")
            )
        unused = sorted(k for k in available - needed if not self.ignorable.search(k))
        if unused:
            raise ConversionError(
                f"HF checkpoint has tensor(s) the {type(self).__name__} does not map (architecture/config mismatch?): "
                f"{unused[:10]}" + (" ..." if len(unused) > 10 else "")
            )


class LlamaStateDictAdapter(StateDictAdapter):
    """`LlamaForCausalLM`-layout checkpoints (`model.` + `lm_head.weight`) <-> a megatron
    `GPTModel` (names relative to the GPTModel, under `mc_prefix`). A tied checkpoint may still
    store `lm_head.weight`; it is ignored on the way in."""

    ignorable = re.compile(r"^lm_head\.weight$")

    def __init__(self, cfg: LLMConfig, mc_prefix: str = "", transformer_impl: str = "local") -> None:
        super().__init__()
        self._add(LlamaDecoderAdapter(cfg, "model.", "lm_head.weight", mc_prefix, transformer_impl))
        if not cfg.tie_word_embeddings:
            self.ignorable = re.compile(r"$^")


class Qwen2StateDictAdapter(LlamaStateDictAdapter):
    """`Qwen2ForCausalLM` <-> a megatron `GPTModel`: the Llama layout with the qkv bias."""


# ----------------------------------------------------------------------------- configs


def _rope_theta(text: dict) -> float:
    if "rope_theta" in text:
        return float(text["rope_theta"])
    rp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rp.get("rope_type", "default") not in ("default", None):
        raise ConversionError(
            f"text_config.rope_parameters.rope_type={rp.get('rope_type')!r} is not supported (default RoPE only)"
        )
    return float(rp.get("rope_theta", 10000.0))


def _decoder_config(text: dict, where: str, qkv_bias: bool) -> LLMConfig:
    if text.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where}.hidden_act={text.get('hidden_act')!r}: expected silu")
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    if text.get("head_dim") not in (None, hidden // heads):
        raise ConversionError(
            f"{where}.head_dim={text['head_dim']}: only hidden_size / num_attention_heads "
            f"= {hidden // heads} is supported"
        )
    return LLMConfig(
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(text["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(text.get("num_key_value_heads") or heads),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rope_theta=_rope_theta(text),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
    )


def check_hf_model(hf: dict, model_type: str, architecture: str) -> None:
    """A config.json of `model_type` whose architectures (when it lists any) include `architecture`."""
    archs = hf.get("architectures") or [architecture]
    if hf.get("model_type") != model_type or architecture not in archs:
        raise ConversionError(
            f"config.json: model_type={hf.get('model_type')!r} architectures={archs}: expected {model_type} / "
            f"{architecture}"
        )


def llm_config_from_hf(text: dict, where: str = "text_config") -> LLMConfig:
    """A Qwen2/2.5 config (dict) -> LLMConfig (qkv bias on)."""
    mt = text.get("model_type", "qwen2")
    if mt not in ("qwen2",):
        raise ConversionError(f"{where}.model_type={mt!r}: only qwen2 (Qwen2/Qwen2.5) decoders are supported")
    if text.get("use_sliding_window"):
        raise ConversionError(f"{where}.use_sliding_window=true is not supported")
    return _decoder_config(text, where, qkv_bias=True)


def llama_config_from_hf(text: dict, where: str = "config", model_types: tuple[str, ...] = ("llama",)) -> LLMConfig:
    """A Llama-style config (`LlamaConfig` or another HF model type with that decoder, named in
    `model_types`; as a dict) -> LLMConfig; refuses what the megatron decoder does not model
    (linear biases, another head_dim, RoPE scaling)."""
    mt = text.get("model_type")
    if mt not in model_types:
        raise ConversionError(f"{where}.model_type={mt!r}: expected one of {list(model_types)}")
    for key in ("attention_bias", "mlp_bias"):
        if text.get(key):
            raise ConversionError(f"{where}.{key}=true is not supported (the decoder has no linear biases)")
    return _decoder_config(text, where, qkv_bias=False)


def hf_llama_text_config(llm: LLMConfig) -> dict:
    """The decoder keys of a Llama-style HF config for `llm` (merged over a model type's own)."""
    if llm.qkv_bias:
        raise ConversionError("a Llama-style HF config has no qkv bias (model.llm.qkv_bias must be false)")
    return dict(
        **hf_decoder_keys(llm),
        attention_bias=False,
        mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta},
    )


def hf_decoder_keys(llm: LLMConfig) -> dict:
    """The keys every HF decoder config (Llama, Qwen2, LLaVA-NeXT's Mistral/Qwen) spells the same
    way for `llm`: sizes, vocabulary, norm epsilon, tied embeddings and the SwiGLU activation."""
    return dict(
        hidden_size=llm.hidden_size,
        intermediate_size=llm.ffn_hidden_size,
        num_hidden_layers=llm.num_layers,
        num_attention_heads=llm.num_attention_heads,
        num_key_value_heads=llm.num_query_groups,
        vocab_size=llm.vocab_size,
        max_position_embeddings=llm.max_position_embeddings,
        rms_norm_eps=llm.rms_norm_eps,
        tie_word_embeddings=llm.tie_word_embeddings,
        hidden_act="silu",
    )
