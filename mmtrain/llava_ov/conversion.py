"""HF <-> megatron checkpoint conversion for LLaVA-OV (library behind `mmtrain convert`).

hf-to-mcore builds the megatron model for the requested TP/PP layout (one process per rank when
TP*PP > 1, gloo on CPU), streams each HF tensor into its shard, and writes a torch_dist
checkpoint (reshardable to any other layout at load time). mcore-to-hf loads the checkpoint at
TP=1/PP=1 and streams tensors out into size-bounded safetensors shards. Host memory stays about
one model copy plus one tensor (import) or one shard (export).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from mmtrain.config.typed import from_plain
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.state_dict_adapter import (
    LlavaOVStateDictAdapter,
    SiglipStateDictAdapter,
    hf_config_from_llava,
    llava_config_from_hf,
    vision_config_from_hf,
)
from mmtrain.models.hf_io import SafetensorsReader, copy_assets, read_config, write_sharded
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.state_dict_adapter import ConversionError, Qwen2StateDictAdapter, llm_config_from_hf
from mmtrain.runtime.checkpoint.weights import MODEL_CONFIG, load_model_config_dict

ASSETS_DIR = "hf_assets"  # tokenizer/processor files carried inside a converted checkpoint


# ----------------------------------------------------------------------------- building


def build_stage(cfg: LlavaOVModelConfig, options: Optional[ParallelOptions] = None):
    """The LlavaOVModel of this rank's pipeline stage."""
    from megatron.core import parallel_state

    from mmtrain.llava_ov.model import LlavaOVModel

    return LlavaOVModel(
        cfg,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        options=options,
    )


def saved_model_config(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> LlavaOVModelConfig:
    """The model config stored next to a checkpoint's weights, validated like a recipe section."""
    return from_plain(LlavaOVModelConfig, load_model_config_dict(ckpt_dir, iteration), f"{ckpt_dir} {MODEL_CONFIG}")


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


def _import_rank(job: dict) -> None:
    """Runs on every rank: build this stage, fill it from HF, save collectively."""
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.checkpoint.weights import save_model_weights
    from mmtrain.runtime.distributed import ensure_model_parallel

    torch.set_num_threads(max(1, int(job.get("threads", 1))))
    ensure_model_parallel(job["tp"], job["pp"], seed=job.get("seed", 1234))
    if job["kind"] == "llava":
        cfg, get = llava_source(job["src"])
    else:
        cfg, get = stage1_source(job["llm"], job["vision"], job.get("base"))
    # a whole LLaVA-OV checkpoint fills every weight: no random init; stage 1 keeps it (projector)
    model = build_stage(cfg, ParallelOptions(perform_initialization=job["kind"] != "llava"))

    # the stage-1 getter returns None for the projector / image_newline: they keep their init
    load_canonical(model, get, tied_output_source=tied_source(cfg))
    save_model_weights([model], job["dst"], iteration=0, model_config=cfg)


def _run_ranks(job: dict, world: int) -> None:
    if world == 1:
        _import_rank(job)
        return
    import torch.multiprocessing as mp

    from mmtrain.runtime.distributed import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_entry, args=(job, r, world, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"conversion failed on rank(s) {bad} (see their error output above)")


def _rank_entry(job: dict, rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _import_rank(job)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _record_source(dst: Path, hf_dirs: list[str | os.PathLike], hf_config: Optional[dict]) -> None:
    assets = dst / ASSETS_DIR
    for d in hf_dirs:
        copy_assets(d, assets)
    if hf_config is not None:
        assets.mkdir(parents=True, exist_ok=True)
        (assets / "source_config.json").write_text(json.dumps(hf_config, indent=2))


def hf_to_mcore(src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, pp: int = 1) -> LlavaOVModelConfig:
    cfg, _ = llava_source(src)  # validate before starting any rank
    _run_ranks({"kind": "llava", "src": str(src), "dst": str(dst), "tp": tp, "pp": pp}, tp * pp)
    _record_source(Path(dst), [src], read_config(src))
    return cfg


def assemble_stage1(llm: str | os.PathLike, vision: str | os.PathLike, dst: str | os.PathLike, tp: int = 1,
                    pp: int = 1, base: Optional[LlavaOVModelConfig] = None) -> LlavaOVModelConfig:
    cfg, _ = stage1_source(llm, vision, base)
    _run_ranks({"kind": "stage1", "llm": str(llm), "vision": str(vision), "base": base, "dst": str(dst),
                "tp": tp, "pp": pp}, tp * pp)
    _record_source(Path(dst), [vision, llm], None)
    return cfg


# ----------------------------------------------------------------------------- mcore -> hf


def mcore_to_hf(src: str | os.PathLike, dst: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Single process: load at TP=1/PP=1 (dist-checkpoint reshards), stream out HF safetensors."""
    from mmtrain.models.model_io import iter_canonical
    from mmtrain.runtime.checkpoint.weights import load_model_weights
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    cfg = saved_model_config(src)
    model = build_stage(cfg, ParallelOptions(perform_initialization=False))
    load_model_weights([model], src)
    canon = dict(iter_canonical(model, true_vocab=cfg.llm.vocab_size))
    adapter = LlavaOVStateDictAdapter(cfg)
    missing = sorted(set(adapter.mcore_names()) - set(canon))
    if missing:
        raise ConversionError(f"checkpoint model lacks tensor(s) {missing[:10]}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    write_sharded(adapter.iter_hf(canon.__getitem__), dst, max_shard_bytes)
    assets = Path(src) / ASSETS_DIR
    template = None
    if (assets / "source_config.json").is_file():
        template = json.loads((assets / "source_config.json").read_text())
    hf_cfg = hf_config_from_llava(cfg, template)
    (dst / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if assets.is_dir():
        for f in assets.iterdir():
            if f.name != "source_config.json":
                shutil.copy2(f, dst / f.name)
    return dst
