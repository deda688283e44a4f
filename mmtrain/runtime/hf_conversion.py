"""How every family's HF <-> megatron conversion runs (the families supply the model, the tensor getters and
the name adapters).
Design notes: docs/conversion.md, "How a family's conversion runs"."""

from __future__ import annotations

import json
import os
import shutil
import sys
from itertools import chain
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

#: set by `mmtrain convert` (unless --verbose): a rank it spawns hides third-party warnings
#: from here on, before megatron is imported (spawned processes inherit no warning filters)
QUIET_ENV = "MMTRAIN_CONVERT_QUIET"
if os.environ.get(QUIET_ENV) == "1":
    from mmtrain.runtime.logs import quiet_third_party

    quiet_third_party()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402

from mmtrain.config.typed import from_plain  # noqa: E402
from mmtrain.models.hf_io import (  # noqa: E402
    DTYPE_NAMES,
    cast_floating,
    copy_assets,
    source_dtype,
    with_config_dtype,
    write_sharded,
)
from mmtrain.models.megatron_config import ParallelOptions  # noqa: E402
from mmtrain.models.model_io import iter_canonical, load_canonical  # noqa: E402
from mmtrain.models.pipeline_split import PipelineSplit, balanced_layers, split_layers  # noqa: E402
from mmtrain.models.state_dict_adapter import ConversionError  # noqa: E402
from mmtrain.runtime.checkpoint.layout import LATEST, find_latest_iteration, iter_dir, unwrap  # noqa: E402
from mmtrain.runtime.checkpoint.weights import (  # noqa: E402
    MODEL_CONFIG,
    load_model_config_dict,
    load_model_weights,
    save_model_weights,
)
from mmtrain.runtime.distributed import ensure_model_parallel, free_port, single_node_env  # noqa: E402

#: inside a converted checkpoint: the source's tokenizer/processor files and its config.json
#: (`source_config.json`), so an export writes them back
ASSETS_DIR = "hf_assets"
SOURCE_CONFIG = "source_config.json"

#: (source args) -> (model config, canonical-tensor getter, tied output source or None); the
#: getter returns None for a parameter that keeps its fresh init
Source = Callable[[dict], tuple[Any, Callable[[str], Optional[torch.Tensor]], Optional[str]]]
#: (model config, ParallelOptions) -> this rank's model stage
BuildStage = Callable[[Any, ParallelOptions], torch.nn.Module]


@dataclass(frozen=True)
class ImportJob:
    source: Source
    source_args: dict
    build_stage: BuildStage
    dst: str
    tp: int = 1
    pp: int = 1
    #: False when the source fills every weight (no random init, no transient init copies)
    fresh_init: bool = False
    seed: int = 1234
    threads: int = 1
    #: the dtype the megatron weights are built and stored in (the saved config's params_dtype);
    #: None: the source's model config's
    params_dtype: Optional[str] = None


def import_to_mcore(job: ImportJob) -> None:
    """Run the import on TP*PP ranks (in this process when that is 1)."""
    world = job.tp * job.pp
    if world == 1:
        _import_rank(job)
        return
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


def _import_rank(job: ImportJob) -> None:
    """On every rank: build this stage, fill it from the source, save collectively."""
    torch.set_num_threads(max(1, job.threads))
    ensure_model_parallel(job.tp, job.pp, seed=job.seed)
    say = _rank0_progress(job.tp * job.pp)
    cfg, get, tied = job.source(job.source_args)
    if job.params_dtype is not None:
        cfg = replace(cfg, params_dtype=job.params_dtype)
    say(f"building the model (tp={job.tp}, pp={job.pp}, {cfg.params_dtype})")
    model = job.build_stage(
        cfg,
        ParallelOptions(perform_initialization=job.fresh_init, pipeline_split=import_split(cfg.llm.num_layers, job.pp)),
    )
    say("filling it from the source")
    load_canonical(model, get, tied_output_source=tied)
    say("saving the megatron checkpoint")
    save_model_weights([model], job.dst, iteration=0, model_config=cfg)


def import_split(num_layers: int, pp: int) -> Optional[PipelineSplit]:
    """The decoder's split over the import's `pp` ranks: megatron's even one where pp divides the
    layers, else as even as they go (`--pp 3` of 28 layers: [9, 9, 10]). Layer numbers are global
    either way, so the checkpoint is the same and loads at any layout."""
    if pp == 1 or num_layers % pp == 0:
        return None
    return split_layers(num_layers, pp, pp_layers=balanced_layers(num_layers, pp))


def _rank0_progress(world: int) -> Callable[[str], None]:
    """Progress lines of an import on stderr, from rank 0 only (the ranks are spawned processes
    without the CLI's logging)."""
    rank = int(os.environ.get("RANK", "0"))

    def say(what: str) -> None:
        if rank == 0:
            print(f"hf-to-mcore: {what}" + (f" [{world} ranks]" if world > 1 else ""), file=sys.stderr, flush=True)

    return say


def _rank_entry(job: ImportJob, rank: int, world: int, port: int) -> None:
    os.environ.update(single_node_env(rank, world, port))
    _import_rank(job)
    dist.barrier()
    dist.destroy_process_group()


def build_pipeline_stage(
    build: Callable[..., torch.nn.Module], cfg: Any, options: Optional[ParallelOptions] = None
) -> torch.nn.Module:
    """`build(cfg, pre_process=, post_process=, options=)` for this rank's pipeline stage."""
    return build(
        cfg,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        options=options,
    )


def load_unsharded(
    ckpt_dir: str | os.PathLike,
    config_cls: type,
    build_stage: BuildStage,
    iteration: Optional[int] = None,
    params_dtype: Optional[str] = None,
) -> tuple[Any, torch.nn.Module]:
    """(model config, model) of a megatron checkpoint at TP=1/PP=1, in this process, weights
    loaded (no random init); `params_dtype` overrides the dtype the model is built in (and the
    config's)."""
    ensure_model_parallel(1, 1)
    cfg = saved_model_config(ckpt_dir, config_cls, iteration)
    if params_dtype is not None:
        cfg = replace(cfg, params_dtype=params_dtype)
    model = build_stage(cfg, ParallelOptions(perform_initialization=False))
    load_model_weights([model], ckpt_dir, iteration)
    return cfg, model


def saved_model_config(ckpt_dir: str | os.PathLike, config_cls: type, iteration: Optional[int] = None) -> Any:
    """The model config stored next to a checkpoint's weights, validated like a recipe section."""
    return from_plain(config_cls, load_model_config_dict(ckpt_dir, iteration), f"{ckpt_dir} {MODEL_CONFIG}")


def import_dtype(requested: str, hf_dir: str | os.PathLike) -> str:
    """The dtype an import stores the megatron weights in: `requested`, or (auto) the HF source's."""
    return source_dtype(hf_dir) if requested == "auto" else requested


def stored_dtype(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> str:
    """The floating dtype holding most of a megatron checkpoint's weights (from its metadata, no
    data): an import's source dtype, a training's precision (bf16 training stores bf16 weights,
    its fp32 master copies live in the optimizer state)."""
    it = find_latest_iteration(ckpt_dir) if iteration is None else iteration
    if it is None:
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint (no 'latest' file and no iter_*/model)")
    names = {v: k for k, v in DTYPE_NAMES.items()}
    elements: dict[str, int] = {}
    for t in dist_checkpointing.load_tensors_metadata(str(iter_dir(ckpt_dir, it) / "model")).values():
        # (type checker: tensors without a dtype give None, looked up as absent)
        name = names.get(getattr(t, "dtype", None))  # type: ignore[arg-type]
        if name is not None:
            elements[name] = elements.get(name, 0) + int(torch.Size(t.global_shape).numel())
    return max(elements, key=elements.__getitem__) if elements else "float32"


def export_dtype(requested: str, ckpt_dir: str | os.PathLike) -> tuple[str, str]:
    """(the dtype the checkpoint's weights are stored in, the dtype the export writes:
    `requested`, or (auto) the stored one)."""
    stored = stored_dtype(ckpt_dir)
    return stored, stored if requested == "auto" else requested


def canonical_tensors(model: torch.nn.Module, true_vocab: int, adapter: Any) -> dict[str, torch.Tensor]:
    """The canonical tensors of an unsharded model (vocab cut to `true_vocab`), checked to hold
    every tensor the family's adapter will ask for."""
    canon = dict(iter_canonical(model, true_vocab=true_vocab))
    missing = sorted(set(adapter.mcore_names()) - set(canon))
    if missing:
        raise ConversionError(f"checkpoint model lacks tensor(s) {missing[:10]}")
    return canon


def record_source(dst: str | os.PathLike, hf_dirs: list[str | os.PathLike], hf_config: Optional[dict]) -> Path:
    """Keep the sources' assets (tokenizer, processor...) and HF config next to the converted
    weights; returns the assets dir."""
    assets = Path(dst) / ASSETS_DIR
    for d in hf_dirs:
        copy_assets(d, assets)
    if hf_config is not None:
        assets.mkdir(parents=True, exist_ok=True)
        (assets / SOURCE_CONFIG).write_text(json.dumps(hf_config, indent=2))
    return assets


def source_config(ckpt_dir: str | os.PathLike) -> Optional[dict]:
    """The HF config recorded at import (the template of an export), if any."""
    f = Path(ckpt_dir) / ASSETS_DIR / SOURCE_CONFIG
    return json.loads(f.read_text()) if f.is_file() else None


def copy_recorded_assets(ckpt_dir: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The recorded asset files (not directories, not the source config) into an HF export."""
    assets = Path(ckpt_dir) / ASSETS_DIR
    if assets.is_dir():
        for f in assets.iterdir():
            if f.is_file() and f.name != SOURCE_CONFIG:
                shutil.copy2(f, Path(dst) / f.name)


def import_weights(
    cfg: Any,
    source: Source,
    source_args: dict,
    build_stage: BuildStage,
    dst: str | os.PathLike,
    tp: int,
    pp: int,
    *,
    dtype: str,
    dtype_from: str | os.PathLike,
    fresh_init: bool = False,
) -> Any:
    """`cfg` with the megatron weights' dtype (`dtype`; auto: the HF dir `dtype_from`'s), and
    the weights `source` gives imported into the checkpoint `dst` at TP/PP (`import_to_mcore`)."""
    cfg = replace(cfg, params_dtype=import_dtype(dtype, dtype_from))
    import_to_mcore(
        ImportJob(
            source, source_args, build_stage, str(dst), tp, pp, fresh_init=fresh_init, params_dtype=cfg.params_dtype
        )
    )
    return cfg


def load_for_export(
    src: str | os.PathLike, config_cls: type, build_stage: BuildStage, dtype: str
) -> tuple[Any, torch.nn.Module, str]:
    """(model config, unsharded model, the export's dtype) of the checkpoint `src`: loaded in the
    dtype its weights are stored in; `dtype` (auto: that one) is what the export writes."""
    stored, out_dtype = export_dtype(dtype, src)
    cfg, model = load_unsharded(src, config_cls, build_stage, params_dtype=stored)
    return cfg, model, out_dtype


def write_hf_dir(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    model: torch.nn.Module,
    adapter: Any,
    true_vocab: int,
    hf_cfg: dict,
    out_dtype: str,
    max_shard_bytes: int,
    *,
    extra_tensors: Iterable[tuple[str, torch.Tensor]] = (),
    dtype_key: str = "dtype",
) -> tuple[Path, dict]:
    """An HF export of the checkpoint `src`: `adapter`'s HF tensors of `model` in `out_dtype`, then
    `extra_tensors`, as sharded safetensors; config.json naming `out_dtype` (under `dtype_key`);
    and the assets recorded at import. Returns the folder and the config written."""
    canon = canonical_tensors(model, true_vocab, adapter)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = chain(cast_floating(adapter.iter_hf(canon.__getitem__), out_dtype), extra_tensors)
    write_sharded(tensors, dst, max_shard_bytes)
    hf_cfg = with_config_dtype(hf_cfg, out_dtype, dtype_key)
    (dst / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    copy_recorded_assets(src, dst)
    return dst, hf_cfg


# ----------------------------------------------------------------------------- HF weights, no files


#: (HF dir) -> (model config, canonical-tensor getter) of a whole HF checkpoint, keys validated
HFSource = Callable[[str | os.PathLike], tuple[Any, Callable[[str], Optional[torch.Tensor]]]]


def is_hf_dir(path: str | os.PathLike) -> bool:
    """An HF model dir (config.json) rather than a megatron checkpoint dir (`latest`)."""
    p = Path(path)
    return (p / "config.json").is_file() and not (p / LATEST).exists()


def load_for_inference(
    ckpt_dir: str | os.PathLike,
    config_cls: type,
    build_stage: BuildStage,
    hf_source: HFSource,
    iteration: Optional[int] = None,
) -> tuple[Any, torch.nn.Module]:
    """(model config, unsharded model) from a megatron checkpoint dir or an HF dir
    (converted on the fly), TP=1/PP=1 in this process, every weight loaded (no random init).
    Built in float32 from either (a converted bf16 checkpoint records bfloat16): the CPU parity
    checks compare in fp32, and generation casts to its own `--dtype`."""
    if not is_hf_dir(ckpt_dir):
        return load_unsharded(ckpt_dir, config_cls, build_stage, iteration, params_dtype="float32")
    ensure_model_parallel(1, 1)
    cfg, get = hf_source(ckpt_dir)
    model = build_stage(cfg, ParallelOptions(perform_initialization=False))
    load_canonical(model, get)
    return cfg, model


def load_hf_into_chunks(
    model_chunks: list[torch.nn.Module],
    hf_dir: str | os.PathLike,
    hf_source: HFSource,
    expect: Any = None,
    architecture_keys: tuple[str, ...] = (),
    tied_output_source: Callable[[Any], Optional[str]] = lambda cfg: None,
) -> None:
    """Fill (possibly TP/PP-sharded) model chunks straight from an HF dir (a recipe's
    `checkpoint.load`), after checking its config against the recipe's model config on the
    family's architecture keys (naming the key that differs). `tied_output_source(cfg)`: see
    `model_io.load_canonical`."""
    cfg, get = hf_source(hf_dir)
    for key in architecture_keys if expect is not None else ():
        if getattr(expect, key) != getattr(cfg, key):
            raise ConversionError(
                f"{hf_dir}: HF config does not match the recipe: model.{key} is {getattr(expect, key)} in the recipe, "
                f"{getattr(cfg, key)} in the HF checkpoint"
            )
    for chunk in model_chunks:
        load_canonical(unwrap(chunk), get, tied_output_source=tied_output_source(cfg))
