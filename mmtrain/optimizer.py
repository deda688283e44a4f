"""Optimizer construction: freezing, param groups, and the CPU/GPU optimizer choice.

- Freezing (`freeze:` in the recipe) happens before DDP wrapping, so frozen parameters get no
  grad buffer and never reach the optimizer (LLaVA-OV stage 1 trains only the projector).
- Param groups: vision tower vs. the rest (the vision tower may have its own peak LR), and
  no weight decay on biases and 1-D parameters (norm scales). Every rank builds the same
  group list (possibly with empty groups) so checkpoints line up across pipeline stages.
- GPU: megatron's `get_megatron_optimizer` (distributed optimizer when configured, bf16 main
  params, its own grad clipping).
- CPU: megatron's optimizer wrappers refuse CPU tensors, so `MainGradAdamW` is the honest
  substitute: `torch.optim.AdamW` stepping on the fp32 `param.main_grad` buffers that megatron
  DDP fills, with global-norm clipping across TP/PP (TP-duplicated and shared params counted
  once, like megatron). Its state is saved through dist-checkpointing with the same sharding
  as the parameters, so it re-shards to another TP/PP layout like the model does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from mmtrain.distributed import ParallelContext

log = logging.getLogger("mmtrain.optimizer")

VISION_TOWER = "vision_tower"
PROJECTOR = "projector"
LLM = "llm"


def param_part(name: str) -> str:
    """Which part of a VLM a parameter belongs to, from its module path."""
    lowered = name.lower()
    if "projector" in lowered or "vision_projection" in lowered:
        return PROJECTOR
    if any(k in lowered for k in ("vision_model", "vision_tower", "vision_encoder", "vision.")):
        return VISION_TOWER
    return LLM


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim <= 1 or name.endswith(".bias")


def apply_freeze(model_chunks: list[torch.nn.Module], freeze_cfg: Any) -> dict[str, int]:
    """requires_grad=False on the frozen parts; returns trainable parameter counts per part."""
    frozen = {
        VISION_TOWER: bool(getattr(freeze_cfg, "vision_tower", False)),
        PROJECTOR: bool(getattr(freeze_cfg, "projector", False)),
        LLM: bool(getattr(freeze_cfg, "llm", False)),
    }
    counts = {VISION_TOWER: 0, PROJECTOR: 0, LLM: 0, "frozen": 0}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            part = param_part(name)
            if frozen[part]:
                param.requires_grad_(False)
                counts["frozen"] += param.numel()
            elif param.requires_grad:
                counts[part] += param.numel()
    return counts


@dataclass(frozen=True)
class GroupSpec:
    vision_tower: bool
    decay: bool


GROUP_ORDER = (GroupSpec(False, True), GroupSpec(False, False), GroupSpec(True, True), GroupSpec(True, False))


def build_param_groups(
    model_chunks: list[torch.nn.Module], optimizer_cfg: Any
) -> list[dict[str, Any]]:
    """The same four groups on every rank (LLM/projector vs vision tower) x (decay / no decay)."""
    lr = float(optimizer_cfg.lr)
    min_lr = float(optimizer_cfg.min_lr)
    vt_lr = getattr(optimizer_cfg, "vision_tower_lr", None)
    vt_lr = lr if vt_lr is None else float(vt_lr)
    buckets: dict[GroupSpec, list[torch.nn.Parameter]] = {g: [] for g in GROUP_ORDER}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            spec = GroupSpec(param_part(name) == VISION_TOWER, not no_weight_decay(name, param))
            buckets[spec].append(param)
    groups = []
    for spec in GROUP_ORDER:
        peak = vt_lr if spec.vision_tower else lr
        groups.append(
            {
                "params": buckets[spec],
                "max_lr": peak,
                "min_lr": min_lr * (peak / lr) if lr > 0 else 0.0,
                "wd_mult": 1.0 if spec.decay else 0.0,
                "is_vision_tower": spec.vision_tower,
                "lr": peak,
                "weight_decay": float(optimizer_cfg.weight_decay) if spec.decay else 0.0,
            }
        )
    return groups


class MainGradAdamW:
    """CPU substitute for megatron's optimizer wrapper (same calls the train loop makes:
    `step() -> (ok, grad_norm, num_zeros)`, `zero_grad`, `param_groups`, `sharded_state_dict`,
    `load_state_dict`)."""

    def __init__(
        self,
        model_chunks: list[torch.nn.Module],
        optimizer_cfg: Any,
        ctx: ParallelContext,
    ) -> None:
        self.model_chunks = model_chunks
        self.clip_grad = float(getattr(optimizer_cfg, "clip_grad", 0.0) or 0.0)
        groups = build_param_groups(model_chunks, optimizer_cfg)
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=float(optimizer_cfg.lr),
            betas=(float(optimizer_cfg.adam_beta1), float(optimizer_cfg.adam_beta2)),
            eps=float(optimizer_cfg.adam_eps),
            weight_decay=float(optimizer_cfg.weight_decay),
            foreach=False,
        )
        self._init_state()

    # -- the megatron-optimizer surface the loop uses -------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        params = list(self.parameters())
        grad_norm = self.grad_norm(params)
        if not math.isfinite(grad_norm):
            log.warning("non-finite grad norm %s: skipping the update", grad_norm)
            return False, grad_norm, None
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            for p in params:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.mul_(coeff)
        for p in params:
            main_grad = getattr(p, "main_grad", None)
            p.grad = None if main_grad is None else main_grad.to(p.dtype)
        self.optimizer.step()
        for p in params:
            p.grad = None
        return True, grad_norm, None

    @torch.no_grad()
    def grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        """L2 norm of the full (unsharded) gradient: local squares of params that are neither
        TP duplicates nor the second copy of a shared (tied) weight, summed over TP x PP."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                continue
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                total += grad.detach().double().pow(2).sum()
        group = parallel_state.get_model_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return float(total.sqrt())

    # -- state ---------------------------------------------------------------------------
    def _init_state(self) -> None:
        """Materialise AdamW's state (zeros, step 0) so that a fresh optimizer and a loaded one
        have the same structure (dist-checkpointing loads into existing tensors)."""
        for p in self.parameters():
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False
    ) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        state_dict = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.parameters())
        steps = {float(s["step"]) for s in state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer steps differ across params: {sorted(steps)}")
        optim_state_to_sharding_state(state_dict, id_map, exclude_keys=("step",))
        # param groups are rebuilt from the recipe (the schedule re-sets lr/wd per step), so only
        # the per-parameter moments and the shared step count are persisted.
        return {"state": state_dict["state"], "common_step": steps.pop() if steps else 0.0}

    def load_sharded(self, loaded: dict[str, Any]) -> None:
        step = torch.tensor(float(loaded.get("common_step", 0.0)))
        current = self.optimizer.state_dict()
        new_state = {}
        for pid, tensors in loaded["state"].items():
            entry = {k: v for k, v in tensors.items()}
            entry["step"] = step.clone()
            new_state[int(pid)] = entry
        current["state"] = new_state
        self.optimizer.load_state_dict(current)


def build_optimizer(
    model_chunks: list[torch.nn.Module], optimizer_cfg: Any, ctx: ParallelContext
) -> Any:
    """megatron's optimizer on GPU; `MainGradAdamW` on CPU (logged once)."""
    if ctx.on_cuda:
        return _build_megatron_optimizer(model_chunks, optimizer_cfg, ctx)
    from mmtrain import device as device_layer

    device_layer.note_runtime_substitution(
        "optimizer: megatron get_megatron_optimizer (CUDA-only) -> torch.optim.AdamW on "
        "param.main_grad with TP/PP-aware global-norm clipping (MainGradAdamW)"
    )
    return MainGradAdamW(model_chunks, optimizer_cfg, ctx)


def _build_megatron_optimizer(
    model_chunks: list[torch.nn.Module], optimizer_cfg: Any, ctx: ParallelContext
) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    config = OptimizerConfig(
        optimizer="adam",
        lr=float(optimizer_cfg.lr),
        min_lr=float(optimizer_cfg.min_lr),
        weight_decay=float(optimizer_cfg.weight_decay),
        adam_beta1=float(optimizer_cfg.adam_beta1),
        adam_beta2=float(optimizer_cfg.adam_beta2),
        adam_eps=float(optimizer_cfg.adam_eps),
        clip_grad=float(optimizer_cfg.clip_grad or 0.0),
        bf16=ctx.precision == "bf16",
        fp16=ctx.precision == "fp16",
        params_dtype=ctx.params_dtype,
        use_distributed_optimizer=ctx.distributed_optimizer,
    )
    overrides = dict(get_standard_config_overrides(config))
    vt_lr = getattr(optimizer_cfg, "vision_tower_lr", None)
    if vt_lr is not None:
        lr = float(optimizer_cfg.lr)
        key = ParamKey(
            with_name_predicate=ParamWithNamePredicate(
                name="vision_tower", fn=lambda param, name: param_part(name) == VISION_TOWER
            )
        )
        overrides[key] = {
            "max_lr": float(vt_lr),
            "min_lr": float(optimizer_cfg.min_lr) * float(vt_lr) / lr if lr else 0.0,
        }
    optimizer = get_megatron_optimizer(config, model_chunks, config_overrides=overrides)
    for group in optimizer.param_groups:
        group["is_vision_tower"] = vt_lr is not None and group.get("max_lr") == float(vt_lr)
    return optimizer
