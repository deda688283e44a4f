"""HF <-> megatron-core names for Emu3 (transformers' `Emu3ForConditionalGeneration`, text model)
and the HF config mapping.

The decoder is the shared Llama-style part (`mmtrain.models.state_dict_adapter`). Names are the
ones transformers writes to disk (the hub layout): `text_model.model.*`, `text_model.lm_head.weight`
and `vqmodel.*`; the in-memory names of transformers 5 (`model.text_model.*`, `lm_head.weight`,
`model.vqmodel.*`) are read as well. The VQ model is not part of the megatron model: its tensors
are kept as HF weights next to the converted checkpoint (conversion.py).
"""

from __future__ import annotations

import re
from typing import Optional

from mmtrain.emu3.config import Emu3ModelConfig
from mmtrain.models.state_dict_adapter import (
    ConversionError,
    LlamaDecoderAdapter,
    StateDictAdapter,
    check_hf_model,
    hf_llama_text_config,
    llama_config_from_hf,
)

TEXT_PREFIX = "text_model.model."
LM_HEAD = "text_model.lm_head.weight"
VQ_PREFIX = "vqmodel."

_HF_ALIASES = [
    (re.compile(r"^model\.text_model\."), TEXT_PREFIX),
    (re.compile(r"^lm_head\."), "text_model.lm_head."),
    (re.compile(r"^model\.vqmodel\."), VQ_PREFIX),
]


def normalize_emu3_hf_key(key: str) -> str:
    for pattern, repl in _HF_ALIASES:
        key = pattern.sub(repl, key)
    return key


class Emu3StateDictAdapter(StateDictAdapter):
    """`Emu3ForConditionalGeneration`'s text model <-> `Emu3Model` (its `language_model.` GPTModel);
    the VQ tensors are ignorable here (they travel separately)."""

    ignorable = re.compile(rf"^{re.escape(VQ_PREFIX)}")

    def __init__(self, cfg: Emu3ModelConfig, transformer_impl: str = "local") -> None:
        super().__init__()
        if cfg.llm.tie_word_embeddings:  # HF Emu3 always stores its lm_head
            raise ConversionError("model.llm.tie_word_embeddings=true: Emu3 checkpoints have an untied lm_head")
        self._add(LlamaDecoderAdapter(cfg.llm, TEXT_PREFIX, LM_HEAD, "language_model.", transformer_impl))

    def normalize_hf_key(self, key: str) -> str:
        return normalize_emu3_hf_key(key)


def emu3_config_from_hf(hf: dict) -> Emu3ModelConfig:
    """`Emu3Config` (config.json dict) -> Emu3ModelConfig (default padding multiple and dtype)."""
    check_hf_model(hf, "emu3", "Emu3ForConditionalGeneration")
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "emu3_text_model")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return Emu3ModelConfig(llm=llama_config_from_hf(text, "text_config", model_types=("emu3_text_model",)))


def hf_config_from_emu3(cfg: Emu3ModelConfig, template: Optional[dict] = None) -> dict:
    """Emu3ModelConfig -> an `Emu3Config` dict on top of `template` (the source's config.json,
    which holds the VQ config and the vocabulary map); its text config is replaced by ours."""
    out = dict(template or {})
    text = dict(out.get("text_config") or {})
    text.update(hf_llama_text_config(cfg.llm), model_type="emu3_text_model")
    text.pop("rope_theta", None)
    out.update(
        model_type="emu3",
        architectures=["Emu3ForConditionalGeneration"],
        text_config=text,
        tie_word_embeddings=cfg.llm.tie_word_embeddings,
    )
    return out
