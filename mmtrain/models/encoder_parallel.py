"""A media encoder with its own parallel layout (`parallel.vision.tp`), independent of the language model's TP.
Design notes: docs/training.md, "A media encoder with its own parallel layout"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from mmtrain.models.layout_rules import check_encoder_tp


def share_sizes(num_tiles: int, num_shares: int) -> list[int]:
    """Tiles of each share: contiguous, in tile order, sizes differing by at most one (the first
    `num_tiles % num_shares` shares take one more). Every rank computes it from the batch's host
    metadata, so no sizes are exchanged."""
    q, r = divmod(num_tiles, num_shares)
    return [q + (i < r) for i in range(num_shares)]


@dataclass(frozen=True)
class EncoderShare:
    """This rank's place in the separate layout: the group that splits a micro-batch's tiles
    (`group`, `size` shares; `order[g]` is the share of the group's rank g), its own share
    (`index`), the CP group its backward sums over and the encoder's TP group."""

    group: Any
    size: int
    index: int
    order: tuple[int, ...]
    #: the shares of this rank's TP row (the ranks with its TP rank over the CP group): [first, first + cp)
    row_first: int
    cp: int
    cp_group: Any
    encoder_tp: int
    lm_tp: int
    #: the encoder's own TP group (a group of this rank alone when it is replicated over the LM's TP)
    encoder_tp_group: Any

    @property
    def replicated_over_tp(self) -> bool:
        """The encoder is whole on every rank of the language model's TP group."""
        return self.encoder_tp == 1 and self.lm_tp > 1

    @property
    def grad_scale(self) -> float:
        """What the encoder output's gradient is multiplied by: megatron averages a TP-replicated
        encoder's weight gradients over TP (`average_gradients_across_tp_domain`), and they must
        be summed."""
        return float(self.lm_tp) if self.replicated_over_tp else 1.0

    @classmethod
    def create(cls, encoder_tp: int, device: torch.device) -> "EncoderShare":
        """From megatron's parallel_state (collective over the TP x CP group: the share order)."""
        lm_tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
        problem = check_encoder_tp(encoder_tp, lm_tp)
        if problem:
            raise ValueError(f"parallel.vision.tp: {problem}")
        if encoder_tp == 1:  # the tiles split over TP x CP, TP-major: a TP row's shares are contiguous
            group, size = ps.get_tensor_and_context_parallel_group(), lm_tp * cp
            tp_index = ps.get_tensor_model_parallel_rank()
            own_tp_group = _own_rank_group() if lm_tp > 1 else ps.get_tensor_model_parallel_group()
        else:  # sharded like the language model: the tiles split over CP
            group, size, tp_index = ps.get_context_parallel_group(), cp, 0
            own_tp_group = ps.get_tensor_model_parallel_group()
        index = tp_index * cp + ps.get_context_parallel_rank()
        order = torch.empty(size, dtype=torch.long, device=device)
        dist.all_gather_into_tensor(order, torch.tensor([index], dtype=torch.long, device=device), group=group)
        return cls(
            group,
            size,
            index,
            tuple(order.tolist()),
            tp_index * cp,
            cp,
            ps.get_context_parallel_group() if cp > 1 else None,
            encoder_tp,
            lm_tp,
            own_tp_group,
        )

    def tower_process_groups(self) -> Any:
        """megatron's ProcessGroupCollection for the encoder's blocks: the runtime's, with the
        encoder's own TP group."""
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
        pgs.tp = self.encoder_tp_group
        return pgs

    def my_tiles(self, num_tiles: int) -> tuple[int, int, list[int]]:
        """(first tile, tile count) of this rank's share, and every share's size."""
        sizes = share_sizes(num_tiles, self.size)
        return sum(sizes[: self.index]), sizes[self.index], sizes


def prepare_groups(encoder_tp: Optional[int]) -> None:
    """The process groups the separate layout needs besides megatron's: a group of each rank alone
    (the TP group of an encoder that is whole on every rank). Collective over the WORLD: every
    rank calls it, in the same order, before its model chunks are built, whether or not it holds
    the encoder (PP stages after the first do not).

    Why every rank: with the default group bound to a device (NCCL, `device_id` given to
    `init_process_group`), torch makes a new group's communicator by splitting the world's
    (torch/distributed/distributed_c10d.py, `_new_process_group_helper`: `split_from` when the
    default group has a `bound_device_id`, passed on as `backend_options.split_from`; ranks outside
    the group join through `perform_nocolor_split`), and ncclCommSplit is collective over the
    parent communicator: a group made by the encoder's ranks alone waits forever for the rest."""
    if encoder_tp == 1 and ps.get_tensor_model_parallel_world_size() > 1:
        _own_rank_group(create=True)


#: (the default group it was made in, this rank's group of one)
_OWN_RANK_GROUP: tuple[Any, Any] = (None, None)


def _own_rank_group(create: bool = False) -> Any:
    """This rank's group of one, made by `prepare_groups` (`create`: make it now, collectively)."""
    global _OWN_RANK_GROUP
    world = dist.group.WORLD
    made_in, group = _OWN_RANK_GROUP
    if made_in is world and group is not None:
        return group
    if not create:
        raise RuntimeError(
            "the vision tower's own layout (parallel.vision.tp=1 with parallel.tp > 1) needs "
            "encoder_parallel.prepare_groups(1) on every rank before the model is built (a group of "
            "each rank alone, made collectively)"
        )
    group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    _OWN_RANK_GROUP = (world, group)
    return group


# ----------------------------------------------------------------------------- the gather


class _GatherShares(torch.autograd.Function):
    """Forward: every share's rows, in share order (all-gather, padded to the largest share).
    Backward: this share's rows of the gradient, summed over the CP group (see the module
    docstring)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, share: EncoderShare, sizes: list[int]) -> torch.Tensor:
        ctx.share, ctx.sizes = share, sizes
        if share.size == 1:
            return local.clone()
        rows = max(sizes)
        padded = local.new_zeros((rows, *local.shape[1:]))
        padded[: local.shape[0]] = local
        out = local.new_empty((share.size * rows, *local.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=share.group)
        blocks = out.view(share.size, rows, *local.shape[1:])
        by_share: list[Optional[torch.Tensor]] = [None] * share.size
        for g, s in enumerate(share.order):
            by_share[s] = blocks[g, : sizes[s]]
        return torch.cat(by_share, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        share, sizes = ctx.share, ctx.sizes
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        lo, hi = starts[share.row_first], starts[share.row_first + share.cp]
        row = grad[lo:hi]
        if share.cp_group is not None:
            row = row.contiguous().clone()
            dist.all_reduce(row, group=share.cp_group)
        mine = row[starts[share.index] - lo : starts[share.index + 1] - lo]
        return mine.contiguous(), None, None


def gather_shares(local: torch.Tensor, share: EncoderShare, sizes: list[int]) -> torch.Tensor:
    """[sizes[share.index], ...] -> [sum(sizes), ...]: every share's encoder output, in tile order.
    Collective over `share.group` (forward) and the CP group (backward): every rank of the group
    calls it for every micro-batch with media, and, when a backward follows, uses its output."""
    if local.shape[0] != sizes[share.index]:
        raise ValueError(f"share {share.index} holds {local.shape[0]} rows, the split gives it {sizes[share.index]}")
    return _GatherShares.apply(local, share, sizes)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x, with its gradient multiplied by `scale` on the way back."""
    return x if scale == 1.0 else _ScaleGradient.apply(x, scale)


# ----------------------------------------------------------------------------- replicated parameters


def mark_replicated_over_tp(module: torch.nn.Module) -> None:
    """Tag an encoder that is whole on every TP rank the way megatron tags its TP-replicated
    parameters: not TP-sharded (grad norm counts it once; converters copy it whole) and averaged
    over TP by `finalize_model_grads`."""
    for param in module.parameters():
        param.tensor_model_parallel = False
        param.partition_dim = -1
        param.partition_stride = 1
        param.average_gradients_across_tp_domain = True


def broadcast_over_tp(module: torch.nn.Module, device: torch.device) -> None:
    """The TP group's replicas start from TP rank 0's freshly initialised weights (on GPU
    megatron draws TP-layer inits from a per-TP-rank RNG stream).

    Each tensor goes through the run's `device`: at build time megatron's own layers sit there
    already (`use_cpu_initialization=False` on GPU) but torch's modules (the patch conv, the
    position embedding, norms) are still on the host until the trainer moves the model, and NCCL
    takes CUDA tensors only (a CPU tensor on an NCCL group: "No backend type associated with
    device type cpu")."""
    src, group = ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        for param in module.parameters():
            staged = param.data if param.device == device else param.data.to(device)
            dist.broadcast(staged, src=src, group=group)
            if staged is not param.data:
                param.data.copy_(staged)


def replicated_sharded_state_dict(sharded: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`sharded` with the entries under `prefix` (an encoder replicated over TP, built with a TP
    group of one) given the replica ids of megatron's TP-replicated tensors, (0, tp rank, dp x cp
    rank): TP rank 0 of DP rank 0 writes them, every rank reads them. Without it every TP rank
    would claim to be the main replica of the same whole tensor."""
    replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
    for key, item in sharded.items():
        if key.startswith(prefix) and hasattr(item, "replica_id"):
            item.replica_id = replica
    return sharded
