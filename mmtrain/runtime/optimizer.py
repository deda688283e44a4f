"""Parts, freezing, param groups and the optimizer (megatron's on GPU, its CPU substitute on CPU).
Design notes: docs/training.md, "Parts, freezing, param groups and the optimizer"."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import package_info
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import distrib_optimizer, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from mmtrain.runtime import cpu_compat
from mmtrain.runtime.checkpoint.layout import unwrap

if TYPE_CHECKING:
    from mmtrain.config.schema import OptimizerConfig
    from mmtrain.runtime.distributed import ParallelContext


class ModelParts:
    """Which declared part each parameter of this rank's model chunks belongs to."""

    def __init__(self, model_chunks: list[torch.nn.Module], parts: dict[str, tuple[str, ...]]) -> None:
        self.names = list(parts)
        self._part_of: dict[int, str] = {}
        for chunk in model_chunks:
            for name, param in unwrap(chunk).named_parameters():
                owners = [
                    part for part, paths in parts.items() if any(name == p or name.startswith(p + ".") for p in paths)
                ]
                if len(owners) != 1:
                    raise ValueError(
                        f"parameter {name!r} belongs to {len(owners)} of the declared parts "
                        f"{dict(parts)} (each parameter must belong to exactly one)"
                    )
                self._part_of[id(param)] = owners[0]

    def part_of(self, param: torch.nn.Parameter) -> str:
        return self._part_of[id(param)]


def apply_freeze(model_chunks: list[torch.nn.Module], parts: ModelParts, frozen: list[str]) -> dict[str, int]:
    """requires_grad=False on the frozen parts; returns trainable parameter counts per part
    (and the frozen total under "frozen")."""
    counts = dict.fromkeys(parts.names, 0) | {"frozen": 0}
    for chunk in model_chunks:
        for param in chunk.parameters():
            part = parts.part_of(param)
            if part in frozen:
                param.requires_grad_(False)
                counts["frozen"] += param.numel()
            elif param.requires_grad:
                counts[part] += param.numel()
    return counts


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim <= 1 or name.endswith(".bias")


def part_lrs(optimizer_cfg: OptimizerConfig, part: str) -> tuple[float, float]:
    """(peak, floor) learning rate of a part."""
    mult = optimizer_cfg.lr_mult.get(part, 1.0)
    return optimizer_cfg.lr * mult, optimizer_cfg.min_lr * mult


def build_param_groups(
    model_chunks: list[torch.nn.Module], parts: ModelParts, optimizer_cfg: OptimizerConfig
) -> list[dict[str, Any]]:
    """The same groups on every rank: (part x decay / no decay), in the family's part order."""
    keys = [(part, decay) for part in parts.names for decay in (True, False)]
    buckets: dict[tuple[str, bool], list[torch.nn.Parameter]] = {k: [] for k in keys}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                buckets[(parts.part_of(param), not no_weight_decay(name, param))].append(param)
    groups = []
    for part, decay in keys:
        peak, floor = part_lrs(optimizer_cfg, part)
        groups.append(
            {
                "params": buckets[(part, decay)],
                "part": part,
                "max_lr": peak,
                "min_lr": floor,
                "wd_mult": 1.0 if decay else 0.0,
                "lr": peak,
                "weight_decay": optimizer_cfg.weight_decay if decay else 0.0,
            }
        )
    return groups


#: megatron's DistributedOptimizer checkpoint format, set explicitly (its default,
#: `fully_sharded_model_space`, is deprecated in 0.16): re-shardable across DP sizes
DISTRIB_OPTIM_SHARDING_TYPE = "fully_reshardable"


def ddp_config_kwargs(ctx: ParallelContext) -> dict[str, Any]:
    """megatron DDP's settings, the same on every device: fp32 grad reduction overlapped with the
    backward pass; with the distributed optimizer, the param all-gather overlapped with the
    forward pass and dispatched by every PP stage at the start of a step (`align_param_gather`)."""
    distributed = ctx.distributed_optimizer
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed,
        overlap_param_gather=distributed,
        align_param_gather=distributed,
        check_for_nan_in_grad=False,
    )


def optimizer_kind(ctx: ParallelContext) -> dict[str, Any]:
    """What the optimizer checkpoint's layout depends on (recorded in trainer_state.json)."""
    if ctx.distributed_optimizer:
        return {"name": "megatron.DistributedOptimizer", "sharding_type": DISTRIB_OPTIM_SHARDING_TYPE}
    mixed = ctx.precision in ("bf16", "fp16")
    return {"name": "megatron.Float16Optimizer" if mixed else "megatron.FP32Optimizer", "sharding_type": "model_space"}


def optimizer_sharded_metadata(ctx: ParallelContext) -> dict[str, Any] | None:
    """The `metadata` megatron's `optimizer.sharded_state_dict` gets (the DistributedOptimizer's
    format named explicitly; None for the others, which take no format)."""
    if ctx.distributed_optimizer:
        return {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING_TYPE}
    return None


def build_optimizer(
    model_chunks: list[torch.nn.Module], parts: ModelParts, optimizer_cfg: OptimizerConfig, ctx: ParallelContext
) -> Any:
    """megatron's optimizer, on every device (CPU: cpu_compat's grad-clipping patch is active)."""
    if ctx.device.type == "cpu" and not cpu_compat.active():
        raise RuntimeError("megatron's optimizer on CPU needs cpu_compat.apply() (runtime.distributed does it)")
    config, overrides = megatron_optimizer_config(parts, optimizer_cfg, ctx)
    with cpu_compat.optimizer_type_checks(ctx.device):
        return get_megatron_optimizer(config, model_chunks, config_overrides=overrides)


#: the megatron-core minor versions whose DistributedOptimizer load `torch_adam_load` was checked with
_TORCH_ADAM_LOAD_VERSIONS = ("0.16.",)


def _torch_adam_distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers in `optimizer` that wrap torch's Adam (neither TE nor apex there)."""
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [
        opt
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(opt, distrib_optimizer.DistributedOptimizer)
    ]


@contextlib.contextmanager
def torch_adam_load(optimizer: Any):
    """Around a checkpoint load into megatron's DistributedOptimizer wrapping torch's Adam (no TE or apex), answer
    where megatron-core 0.16's load assumes FusedAdam's state.
    Design notes: docs/gpu.md, "Loading a DistributedOptimizer checkpoint around torch's Adam"."""
    targets = _torch_adam_distributed_optimizers(optimizer)
    version = package_info.__version__
    if targets and not version.startswith(_TORCH_ADAM_LOAD_VERSIONS):
        raise RuntimeError(
            f"mmtrain answers megatron-core {_TORCH_ADAM_LOAD_VERSIONS}'s DistributedOptimizer load "
            f"around torch's Adam, found {version}: re-check distrib_optimizer.py's state_dict, "
            "load_state_dict and _set_main_param_and_optimizer_states, and this function"
        )
    for opt in targets:
        if len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
        opt._set_main_param_and_optimizer_states = functools.partial(
            _set_states_keeping_step, opt, type(opt)._set_main_param_and_optimizer_states
        )
    try:
        yield
    finally:
        for opt in targets:
            opt.__dict__.pop("_set_main_param_and_optimizer_states", None)
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _set_states_keeping_step(
    opt: Any, original: Any, model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]
) -> None:
    if "step" not in tensors:
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        step = opt.optimizer.state[main_param].get("step")
        if step is not None:
            tensors = {**tensors, "step": step}
    original(opt, model_param, tensors)


def megatron_optimizer_config(
    parts: ModelParts, optimizer_cfg: OptimizerConfig, ctx: ParallelContext
) -> tuple[Any, dict]:
    """megatron's OptimizerConfig and its param-group overrides: no weight decay on biases and
    1-D params (megatron's standard overrides), and each part's LRs (`part_lrs`) where they
    differ from the base LR (parameters matched by identity through `parts`)."""
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optimizer_cfg.lr,
        min_lr=optimizer_cfg.min_lr,
        weight_decay=optimizer_cfg.weight_decay,
        adam_beta1=optimizer_cfg.adam_beta1,
        adam_beta2=optimizer_cfg.adam_beta2,
        adam_eps=optimizer_cfg.adam_eps,
        clip_grad=optimizer_cfg.clip_grad,
        bf16=ctx.precision == "bf16",
        fp16=ctx.precision == "fp16",
        params_dtype=ctx.params_dtype,
        use_distributed_optimizer=ctx.distributed_optimizer,
        overlap_param_gather=ctx.distributed_optimizer,  # as on the DDP config (ddp_config_kwargs)
    )
    overrides = dict(get_standard_config_overrides(config))
    for part in parts.names:
        peak, floor = part_lrs(optimizer_cfg, part)
        if peak != optimizer_cfg.lr:
            key = ParamKey(
                predicate=ParamPredicate(name=f"part:{part}", fn=lambda p, part=part: parts.part_of(p) == part)
            )
            # lr_mult only tags the group: megatron matches saved to current param groups by
            # (wd_mult, lr_mult, ...) (`_filter_and_reorder_param_groups`), so a part with its
            # own LR needs its own key there (our LRSchedule reads max_lr/min_lr only)
            mult = optimizer_cfg.lr_mult.get(part, 1.0)
            overrides[key] = {"max_lr": peak, "min_lr": floor, "lr_mult": mult}
    return config, overrides
