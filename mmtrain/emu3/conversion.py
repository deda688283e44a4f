"""HF <-> megatron checkpoint conversion for Emu3 (library behind `mmtrain convert --model emu3`),
run by the shared machinery in mmtrain/runtime/hf_conversion.py (any TP/PP, streaming).

hf-to-mcore converts the text model of a transformers `Emu3ForConditionalGeneration` dir and
keeps everything else next to the weights, as HF files:

    CKPT/latest, CKPT/iter_0000000/{model/, model_config.yaml}     the decoder (megatron)
    CKPT/hf_assets/                    tokenizer / processor files, source_config.json
    CKPT/hf_assets/vq/                 the VQ model as an `Emu3VQVAE` dir (config.json,
                                       model.safetensors, preprocessor_config.json): usable as
                                       `mmdata tokenize-images --vision-tokenizer CKPT/hf_assets/vq`

mcore-to-hf writes the whole `Emu3ForConditionalGeneration` back (text weights + the kept VQ,
config.json from the recorded source config). A checkpoint that was never converted from HF
(e.g. trained from scratch, or from `checkpoint.load` of an HF dir) has no kept VQ: the export
then takes `--vq DIR` (a VQ dir or an HF Emu3 dir) and `--tokenizer DIR` (the vocabulary map).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from transformers import AutoTokenizer

from mmdata.vision_tokens.vq import VQError, check_vq_dir
from mmtrain.emu3.config import Emu3ModelConfig
from mmtrain.emu3.image_area import record_trained_image_area
from mmtrain.emu3.model import Emu3Model
from mmtrain.emu3.state_dict_adapter import (
    VQ_PREFIX,
    Emu3StateDictAdapter,
    emu3_config_from_hf,
    hf_config_from_emu3,
    normalize_emu3_hf_key,
)
from mmtrain.models.hf_io import (
    SafetensorsReader,
    cast_floating,
    copy_assets,
    read_config,
    write_sharded,
)
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.state_dict_adapter import ConversionError
from mmtrain.runtime.hf_conversion import (
    ASSETS_DIR,
    build_pipeline_stage,
    import_weights,
    load_for_export,
    record_source,
    source_config,
    write_hf_dir,
)

#: the kept VQ model inside a converted checkpoint
VQ_DIR = "vq"
PROCESSOR_FILE = "preprocessor_config.json"


def build_stage(cfg: Emu3ModelConfig, options: Optional[ParallelOptions] = None):
    """The Emu3Model of this rank's pipeline stage."""
    return build_pipeline_stage(Emu3Model, cfg, options)


def emu3_source(hf_dir: str | os.PathLike) -> tuple[Emu3ModelConfig, Callable[[str], torch.Tensor]]:
    """An HF Emu3 dir -> (config, canonical-megatron-tensor getter), keys validated."""
    cfg = emu3_config_from_hf(read_config(hf_dir))
    adapter = Emu3StateDictAdapter(cfg)
    reader = SafetensorsReader(hf_dir, adapter.normalize_hf_key)
    adapter.check_hf_keys(reader.keys())
    return cfg, lambda name: adapter.mcore_tensor(name, reader.get)


def _import_source(args: dict):
    cfg, get = emu3_source(args["src"])
    return cfg, get, None  # untied


# ----------------------------------------------------------------------------- the VQ model


def _vq_tensors(vq_dir: str | os.PathLike) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(raw VQ config, (Emu3VQVAE name, tensor) stream) of a VQ-only dir or a whole HF Emu3 dir."""
    try:
        layout, vq_config = check_vq_dir(vq_dir)
    except VQError as exc:
        raise ConversionError(str(exc)) from None
    # a VQ-only dir names tensors as Emu3VQVAE does; a whole Emu3 dir puts them under vqmodel.
    prefix = "" if layout == "emu3_vqgan" else VQ_PREFIX
    reader = SafetensorsReader(vq_dir, normalize_emu3_hf_key if prefix else lambda k: k)
    names = sorted(k[len(prefix) :] for k in reader.keys() if k.startswith(prefix))
    if not names:
        raise ConversionError(f"{vq_dir}: no VQ tensors")
    return dict(vq_config), ((k, reader.get(prefix + k)) for k in names)


def keep_vq(hf_dir: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The VQ model of an HF Emu3 dir as an `Emu3VQVAE` dir under `dst` (streamed)."""
    vq_config, tensors = _vq_tensors(hf_dir)
    out = Path(dst)
    write_sharded(tensors, out)
    (out / "config.json").write_text(
        json.dumps({**vq_config, "model_type": "emu3_vqgan", "architectures": ["Emu3VQVAE"]}, indent=2)
    )
    if (Path(hf_dir) / PROCESSOR_FILE).is_file():
        (out / PROCESSOR_FILE).write_bytes((Path(hf_dir) / PROCESSOR_FILE).read_bytes())
    return out


# ----------------------------------------------------------------------------- hf -> mcore


def hf_to_mcore(
    src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, pp: int = 1, dtype: str = "auto"
) -> Emu3ModelConfig:
    """`dtype`: the megatron decoder's (auto: the source's, recorded as the saved params_dtype);
    the kept VQ model stays as the source stores it."""
    cfg, _ = emu3_source(src)  # validate the text model before starting any rank...
    assets = record_source(dst, [src], read_config(src))
    keep_vq(src, assets / VQ_DIR)  # ...and the VQ (refused with a reason, e.g. no processor config)
    return import_weights(cfg, _import_source, {"src": str(src)}, build_stage, dst, tp, pp, dtype=dtype, dtype_from=src)


# ----------------------------------------------------------------------------- mcore -> hf


def mcore_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_shard_bytes: int = 2 * 1024**3,
    *,
    vq: Optional[str | os.PathLike] = None,
    tokenizer: Optional[str | os.PathLike] = None,
    dtype: str = "auto",
) -> Path:
    """Single process: the decoder at TP=1/PP=1 plus the VQ model (kept at import, or `vq`)
    -> an `Emu3ForConditionalGeneration` dir. `dtype`: the tensors' and config.json's (auto: the
    dtype the megatron weights are stored in; the VQ's tensors then stay as they are stored)."""
    template = source_config(src) or {}
    vq_dir = Path(vq) if vq is not None else Path(src) / ASSETS_DIR / VQ_DIR
    if not (vq_dir / "config.json").is_file():
        raise ConversionError(
            f"{src}: no VQ model kept alongside the weights (the checkpoint was not converted from "
            "an HF Emu3 dir); give --vq VQ_DIR (an Emu3VQVAE dir or an HF Emu3 dir) "
            "and --tokenizer TOKENIZER_DIR"
        )
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        template["vocabulary_map"] = tok.get_vocab()
        template["text_config"] = {
            **template.get("text_config", {}),
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        }
    if "vocabulary_map" not in template:
        raise ConversionError(f"{src}: no vocabulary map recorded; give --tokenizer TOKENIZER_DIR (the Emu3 tokenizer)")
    cfg, model, out_dtype = load_for_export(src, Emu3ModelConfig, build_stage, dtype)
    vq_config, vq_tensors = _vq_tensors(vq_dir)
    if vq is not None or "vq_config" not in template:
        template["vq_config"] = {**vq_config, "model_type": "emu3_vqgan"}
    vq_stream = cast_floating(((VQ_PREFIX + k, t) for k, t in vq_tensors), None if dtype == "auto" else out_dtype)
    hf_cfg = hf_config_from_emu3(cfg, template)
    dst, _ = write_hf_dir(
        src,
        dst,
        model,
        Emu3StateDictAdapter(cfg),
        cfg.llm.vocab_size,
        hf_cfg,
        out_dtype,
        max_shard_bytes,
        extra_tensors=vq_stream,
    )
    for extra in (tokenizer, vq_dir):
        if extra is not None:
            copy_assets(extra, dst)
    record_trained_image_area(src, dst / PROCESSOR_FILE)  # the token shards' area, not the VQ's default
    return dst
