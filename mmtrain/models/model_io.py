"""Put canonical (TP=1, global-layer-numbered) megatron tensors into a possibly TP/PP-sharded
model, and read them back out of an unsharded one.

TP sharding follows the attributes megatron sets on its parameters (`tensor_model_parallel`,
`partition_dim`), with the two layouts that need more than a plain chunk: the SwiGLU `linear_fc1`
([gate; up] -> each rank holds [gate_r; up_r]) and the vocab (padded to the model's size first).
PP stages number their layers from 0; the global number comes from each layer's `layer_number`.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

import torch
from megatron.core import parallel_state

from mmtrain.models.state_dict_adapter import ConversionError

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(.*)$")
_VOCAB = re.compile(r"(^|\.)(embedding\.word_embeddings|output_layer)\.weight$")


def canonical_name(model: torch.nn.Module, local_name: str) -> str:
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    layer = model.get_submodule(m.group(1) + m.group(2))
    global_idx = int(getattr(layer, "layer_number", int(m.group(2)) + 1)) - 1
    return f"{m.group(1)}{global_idx}.{m.group(3)}"


def _is_gated_fc1(model: torch.nn.Module, local_name: str) -> bool:
    if not local_name.endswith("mlp.linear_fc1.weight") and not local_name.endswith("mlp.linear_fc1.bias"):
        return False
    mlp = model.get_submodule(local_name.rsplit(".", 2)[0])
    return bool(getattr(mlp.config, "gated_linear_unit", False))


def shard_for(full: torch.Tensor, param: torch.Tensor, name: str, gated: bool, tp_rank: int, tp: int) -> torch.Tensor:
    if _VOCAB.search(name):
        rows = param.shape[0] * (tp if getattr(param, "tensor_model_parallel", False) else 1)
        if full.shape[0] > rows or full.shape[1:] != param.shape[1:]:
            raise ConversionError(
                f"{name}: checkpoint tensor {tuple(full.shape)} does not fit vocab table of {rows} rows x "
                f"{tuple(param.shape[1:])}"
            )
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))], dim=0)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = int(param.partition_dim)
    if full.shape[dim] % tp:
        raise ConversionError(f"{name}: dim {dim} of {tuple(full.shape)} is not divisible by TP={tp}")
    if gated:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[tp_rank], torch.chunk(up, tp, dim=0)[tp_rank]], dim=0)
    return torch.chunk(full, tp, dim=dim)[tp_rank]


def load_canonical(
    model: torch.nn.Module,
    get_canonical: Callable[[str], Optional[torch.Tensor]],
    *,
    tied_output_source: str | None = None,
) -> list[str]:
    """Copy every parameter of `model` from `get_canonical(canonical_name)`; returns the names
    loaded. A getter returns None only for parameters that are meant to keep their init; a
    tensor it does not know must raise (never a silently half-loaded model).

    `tied_output_source`: with tied embeddings the last PP stage still owns an `output_layer`
    copy of the embedding; it is filled from this canonical name.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    done = []
    for local, param in model.named_parameters():
        cname = canonical_name(model, local)
        src = cname
        if tied_output_source and cname.endswith("output_layer.weight"):
            src = tied_output_source
        full = get_canonical(src)
        if full is None:  # the source deliberately has no value (e.g. a fresh stage-1 projector)
            continue
        shard = shard_for(full, param, cname, _is_gated_fc1(model, local), tp_rank, tp)
        if tuple(shard.shape) != tuple(param.shape):
            raise ConversionError(
                f"{cname}: checkpoint gives {tuple(full.shape)} (shard {tuple(shard.shape)}), model expects "
                f"{tuple(param.shape)} "
                f"at TP={tp}"
            )
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))
        done.append(cname)
    return done


def iter_canonical(model: torch.nn.Module, true_vocab: int | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """Canonical tensors of an unsharded (TP=1, PP=1) model; vocab tables cut to `true_vocab`."""
    if (
        parallel_state.get_tensor_model_parallel_world_size() != 1
        or parallel_state.get_pipeline_model_parallel_world_size() != 1
    ):
        raise RuntimeError("iter_canonical needs an unsharded model (TP=1, PP=1); load the checkpoint at that layout")
    for local, param in model.named_parameters():
        t = param.detach()
        if true_vocab is not None and _VOCAB.search(local):
            t = t[:true_vocab]
        yield canonical_name(model, local), t
