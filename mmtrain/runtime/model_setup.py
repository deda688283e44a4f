"""This rank's model, ready for megatron's schedules: the parallel options the family's builder
gets, one chunk per (virtual) pipeline stage, the chunks wrapped in megatron DDP, and the
overlapped parameter all-gathers of the distributed optimizer."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.utils import get_model_config

from mmdata.units import plural
from mmtrain.config.schema import Recipe
from mmtrain.models.lm_loss import resolve_loss_impl
from mmtrain.models.megatron_config import ParallelOptions, TransformerImplUnavailable, resolve_decoder_fusions
from mmtrain.models.pipeline_split import PipelineSplit
from mmtrain.models.te_support import te_status
from mmtrain.runtime import cpu_compat
from mmtrain.runtime.cuda_settings import cp_comm_type_problem
from mmtrain.runtime.distributed import ParallelContext, UnsupportedLayout
from mmtrain.runtime.optimizer import ddp_config_kwargs
from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


def model_options(
    recipe: Recipe, spec: FamilySpec, ctx: ParallelContext, pipeline_split: Optional[PipelineSplit]
) -> ParallelOptions:
    """What the model builder needs to know about parallelism/memory (sizes come from
    megatron's parallel_state)."""
    p = recipe.parallel
    some_layers = p.recompute_num_layers  # 0: every layer (uniform, one at a time)
    try:
        lm_loss = resolve_loss_impl(p.lm_loss, tp=ctx.tp, dtype=ctx.params_dtype, on_cuda=ctx.on_cuda)
    except ValueError as err:
        raise UnsupportedLayout(str(err)) from None
    if ctx.rank == 0:
        log.info(
            "LM loss: %s (parallel.lm_loss=%s)%s",
            lm_loss,
            p.lm_loss,
            f"; context parallelism cp={ctx.cp}, cp_comm_type={p.cp_comm_type}" if ctx.cp > 1 else "",
        )
    if ctx.cp > 1 and ctx.on_cuda:
        check_cp_comm_type(recipe, spec)
    if ctx.cp > 1 and not ctx.on_cuda:
        cpu_compat.note(
            "context parallelism: Transformer Engine's CP attention (GPU) -> K/V all-gather over "
            f"gloo (KVAllGatherCoreAttention); parallel.cp_comm_type={p.cp_comm_type} applies on GPU"
        )
    options = ParallelOptions(
        sequence_parallel=ctx.sequence_parallel,
        recompute_granularity=None if ctx.recompute == "none" else ctx.recompute,
        recompute_method="block" if some_layers else "uniform",
        recompute_num_layers=some_layers or 1,
        params_dtype=ctx.params_dtype_name,
        lm_loss=lm_loss,
        lm_loss_block_mb=p.lm_loss_block_mb,
        cp_comm_type=p.cp_comm_type,
        hierarchical_cp_sizes=p.hierarchical_cp_sizes or None,
        transformer_impl=p.transformer_impl,
        on_cuda=ctx.on_cuda,
        deterministic=recipe.train.deterministic,
        encoder_tp=p.vision.tp,
        pipeline_split=pipeline_split,
    )
    if p.vision.tp is not None and ctx.rank == 0:
        log.info(
            "vision tower: its own layout, TP %d; a micro-batch's tiles split over %s, each encoding "
            "its share (parallel.vision.tp)",
            p.vision.tp,
            plural(ctx.tp // p.vision.tp * ctx.cp, "rank"),
        )
    try:
        resolve_decoder_fusions(options)  # transformer_engine off CUDA or without TE: one clear line
    except TransformerImplUnavailable as err:
        raise UnsupportedLayout(str(err)) from None
    return options


def check_cp_comm_type(recipe: Recipe, spec: FamilySpec) -> None:
    """TE's context-parallel attention on packed sequences, for this TE version (every decoder call is packed)."""
    d = spec.model_shapes(recipe.model).decoder
    p = recipe.parallel
    problem = cp_comm_type_problem(p.cp_comm_type, p.cp, p.tp, d.kv_groups, d.heads, te_status().version_tuple())
    if problem:
        raise UnsupportedLayout(problem)


def build_model_chunks(
    spec: FamilySpec, recipe: Recipe, ctx: ParallelContext, options: ParallelOptions
) -> list[torch.nn.Module]:
    """This rank's model chunks: one pipeline stage, or with virtual stages (`parallel.vpp`) one
    chunk per virtual stage, each knowing its `vp_stage` (megatron-LM's `get_model`). The chunk
    holding the model's first layers (pre_process) is where a family puts its encoders."""
    chunks = []
    for vp in range(ctx.vpp):
        vp_stage = vp if ctx.vpp > 1 else None
        chunk = spec.build_model(
            recipe.model,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            options=options,
            vp_stage=vp_stage,
        )
        if ctx.on_cuda:
            chunk = chunk.cuda(torch.cuda.current_device())
        if not hasattr(chunk, "model_type"):  # megatron's schedules read it
            chunk.model_type = ModelType.encoder_or_decoder
        chunks.append(chunk)
    return chunks


def wrap_in_ddp(chunks: list[torch.nn.Module], ctx: ParallelContext) -> tuple[list[Any], list[Any]]:
    """The chunks in megatron DDP, and their model configs set for the train loop's loss
    convention (per token: mmtrain/runtime/trainer.py), packed pipelines and DDP's hooks."""
    configs = [get_model_config(chunk) for chunk in chunks]  # the schedules read the first one's
    for config in configs:  # before DDP, which sizes its gradient scaling from them
        config.calculate_per_token_loss = True  # see the docstring of runtime/trainer.py
        config.timers = None
        if ctx.pp > 1:
            # packed micro-batches are flattened to one [B*S] stream whose length may vary
            config.variable_seq_lengths = True
            if config.pipeline_dtype is None:
                config.pipeline_dtype = ctx.params_dtype
    ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(ctx))
    # megatron-LM's wrapping: one DDP per model chunk, buckets only on the first (the later
    # chunks' reductions overlap with the compute of the others anyway)
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, (chunk, config) in enumerate(zip(chunks, configs))
    ]
    for ddp in model:
        ddp.broadcast_params()  # DP replicas start identical whatever the init RNG did
    no_sync = [ddp.no_sync for ddp in model]
    for config in configs:
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        config.finalize_model_grads_func = finalize_model_grads
    return model, configs


def overlapped_param_gather(model: list[Any]) -> list[Any]:
    """The DDP chunks whose updated weights reach them by an all-gather overlapped with the next
    forward (distributed optimizer with overlap_param_gather): after `optimizer.step()` each DP
    rank holds only its own shard until then."""
    return [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]


def dispatch_param_gather(model: list[Any]) -> None:
    """With `align_param_gather` the forward hooks dispatch nothing ahead: every PP stage starts
    all its buckets' all-gathers here, at once, and the hooks wait for the ones they need (what
    megatron's `config.param_sync_func` does in its interleaved schedule)."""
    for chunk in overlapped_param_gather(model):
        chunk.start_param_sync()


def finish_param_gather(model: list[Any]) -> None:
    """Complete weights in every DP rank before they are saved (megatron-LM disables the forward
    pre-hook with a param sync around its checkpoint saves for the same reason)."""
    for chunk in overlapped_param_gather(model):
        chunk.start_param_sync(force_sync=True)


def split_text(split: PipelineSplit) -> str:
    """` (decoder layers per stage [1, 3], virtual stages 2)` for the set-up line."""
    virtual = f", {split.vpp} virtual stages per rank (interleaved 1F1B)" if split.vpp > 1 else ""
    return f" (decoder layers per stage {split.describe()}{virtual})"
