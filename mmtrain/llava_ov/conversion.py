"""HF <-> megatron checkpoint conversion for LLaVA-OV (library behind `mmtrain convert`): the
LLaVA-OV sources (a whole checkpoint; a Qwen2 LLM + SigLIP for stage 1) and the HF config on
export, run by the shared machinery in mmtrain/runtime/hf_conversion.py (any TP/PP, streaming).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.state_dict_adapter import (
    LlavaOVStateDictAdapter,
    SiglipStateDictAdapter,
    hf_config_from_llava,
    llava_config_from_hf,
    vision_config_from_hf,
)
from mmtrain.models.hf_io import SafetensorsReader, read_config, write_sharded
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.state_dict_adapter import ConversionError, Qwen2StateDictAdapter, llm_config_from_hf
from mmtrain.runtime import hf_conversion
from mmtrain.runtime.hf_conversion import (
    ImportJob,
    build_pipeline_stage,
    canonical_tensors,
    copy_recorded_assets,
    import_to_mcore,
    load_unsharded,
    record_source,
    source_config,
)

# ----------------------------------------------------------------------------- building


def build_stage(cfg: LlavaOVModelConfig, options: Optional[ParallelOptions] = None):
    """The LlavaOVModel of this rank's pipeline stage."""
    from mmtrain.llava_ov.spec import build_model

    return build_pipeline_stage(build_model, cfg, options)


def saved_model_config(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> LlavaOVModelConfig:
    """The model config stored next to a checkpoint's weights, validated like a recipe section."""
    return hf_conversion.saved_model_config(ckpt_dir, LlavaOVModelConfig, iteration)


def tied_source(cfg: LlavaOVModelConfig) -> Optional[str]:
    return "language_model.embedding.word_embeddings.weight" if cfg.llm.tie_word_embeddings else None


# ----------------------------------------------------------------------------- HF sources


def llava_source(hf_dir: str | os.PathLike) -> tuple[LlavaOVModelConfig, Callable[[str], torch.Tensor]]:
    """A whole LLaVA-OV HF dir -> (config, canonical-megatron-tensor getter), keys validated."""
    cfg = llava_config_from_hf(read_config(hf_dir))
    adapter = LlavaOVStateDictAdapter(cfg)
    reader = SafetensorsReader(hf_dir, adapter.normalize_hf_key)
    adapter.check_hf_keys(reader.keys())
    return cfg, lambda name: adapter.mcore_tensor(name, reader.get)


def stage1_source(llm_dir: str | os.PathLike, vision_dir: str | os.PathLike, base: Optional[LlavaOVModelConfig] = None,
                  drop_last_vision_layers: int = 1):
    """Qwen2 LLM + SigLIP -> (config, getter); projector and image_newline keep their fresh init
    (getter returns None for them)."""
    text = read_config(llm_dir)
    archs = text.get("architectures") or []
    if text.get("model_type") != "qwen2" or (archs and "Qwen2ForCausalLM" not in archs):
        raise ConversionError(f"{llm_dir}/config.json: model_type={text.get('model_type')!r} architectures={archs}: expected a Qwen2ForCausalLM")
    vis = read_config(vision_dir)
    if vis.get("model_type") == "siglip":
        vis = vis["vision_config"] | {"model_type": "siglip_vision_model"}
    src_layers = int(vis["num_hidden_layers"])
    keep = src_layers - drop_last_vision_layers
    base = base or LlavaOVModelConfig()
    cfg = replace(base, llm=llm_config_from_hf(text, "config"), vision=vision_config_from_hf(vis, keep, "config"))
    llm_reader = SafetensorsReader(llm_dir)
    llm_ad = Qwen2StateDictAdapter(cfg.llm, "language_model.")
    llm_ad.check_hf_keys(llm_reader.keys())
    vis_ad = SiglipStateDictAdapter(cfg.vision, "vision_model.", source_layers=src_layers)
    vis_reader = SafetensorsReader(vision_dir, vis_ad.normalize_hf_key)
    vis_ad.check_hf_keys(vis_reader.keys())

    def get(name: str):
        if name.startswith("language_model."):
            return llm_ad.mcore_tensor(name, llm_reader.get)
        if name.startswith("vision_model."):
            return vis_ad.mcore_tensor(name, vis_reader.get)
        return None  # projector / image_newline: freshly initialised

    return cfg, get


# ----------------------------------------------------------------------------- hf -> mcore


def _whole_source(args: dict):
    cfg, get = llava_source(args["src"])
    return cfg, get, tied_source(cfg)


def _stage1_source(args: dict):
    cfg, get = stage1_source(args["llm"], args["vision"], args.get("base"))
    return cfg, get, tied_source(cfg)


def hf_to_mcore(src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, pp: int = 1) -> LlavaOVModelConfig:
    cfg, _ = llava_source(src)  # validate before starting any rank
    # a whole LLaVA-OV checkpoint fills every weight: no random init
    import_to_mcore(ImportJob(_whole_source, {"src": str(src)}, build_stage, str(dst), tp, pp))
    record_source(dst, [src], read_config(src))
    return cfg


def assemble_stage1(llm: str | os.PathLike, vision: str | os.PathLike, dst: str | os.PathLike, tp: int = 1,
                    pp: int = 1, base: Optional[LlavaOVModelConfig] = None) -> LlavaOVModelConfig:
    cfg, _ = stage1_source(llm, vision, base)
    # the stage-1 getter returns None for the projector / image_newline: they keep their init
    import_to_mcore(ImportJob(_stage1_source, {"llm": str(llm), "vision": str(vision), "base": base},
                              build_stage, str(dst), tp, pp, fresh_init=True))
    record_source(dst, [vision, llm], None)
    return cfg


# ----------------------------------------------------------------------------- mcore -> hf


def mcore_to_hf(src: str | os.PathLike, dst: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Single process: load at TP=1/PP=1 (dist-checkpoint reshards), stream out HF safetensors."""
    cfg, model = load_unsharded(src, LlavaOVModelConfig, build_stage)
    adapter = LlavaOVStateDictAdapter(cfg)
    canon = canonical_tensors(model, cfg.llm.vocab_size, adapter)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    write_sharded(adapter.iter_hf(canon.__getitem__), dst, max_shard_bytes)
    hf_cfg = hf_config_from_llava(cfg, source_config(src))
    (dst / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    copy_recorded_assets(src, dst)
    return dst
