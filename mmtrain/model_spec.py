"""Per-model-family registry (like torchtitan's TrainSpec). The shared runtime (launch,
distributed init, train loop, checkpoints, metrics, recipes) is model-agnostic and only
calls what a `ModelSpec` provides. Adding a family = adding a folder that registers one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class ModelSpec:
    name: str  # CLI name, e.g. "llava-ov"
    # dataclass type of the recipe's `model:` section
    model_config_cls: type
    # (model_config, *, pre_process, post_process, parallel_ctx) -> torch.nn.Module (one PP stage)
    build_model: Callable[..., torch.nn.Module]
    # (recipe, *, dp_rank, dp_size) -> energon savable loader yielding batches
    build_loader: Callable[..., Any]
    # megatron-style forward step: (data_iterator, model) -> (output_tensor, loss_fn)
    forward_step: Callable[..., Any]
    # (model_config, seq_length) -> training FLOPs per token (for MFU)
    flops_per_token: Callable[..., float]
    # HF <-> mcore state-dict adapter class (see mmtrain/llava_ov/state_dict_adapter.py)
    state_dict_adapter: type | None = None


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    import importlib

    if name not in _REGISTRY:
        module = {"llava-ov": "mmtrain.llava_ov.spec", "emu3": "mmtrain.emu3.spec"}.get(name)
        if module is None:
            raise KeyError(f"unknown model family {name!r}; known: llava-ov, emu3")
        importlib.import_module(module)
    return _REGISTRY[name]
