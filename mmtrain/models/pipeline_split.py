"""Which decoder layers each pipeline stage holds: megatron's even split, an uneven split (`parallel.pp_layers`)
and virtual stages (`parallel.vpp`).
Design notes: docs/training.md, "Pipeline stages: even, uneven and virtual splits"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mmdata.units import plural


class PipelineSplitError(ValueError):
    """A pipeline split megatron cannot build (the message names the recipe keys)."""


@dataclass(frozen=True)
class PipelineSplit:
    """Decoder layers of every model chunk: `counts[pp_rank][vp_stage]`."""

    counts: tuple[tuple[int, ...], ...]
    #: from `parallel.pp_layers` (given to megatron as its layout) rather than megatron's even split
    explicit: bool = False

    @property
    def pp(self) -> int:
        return len(self.counts)

    @property
    def vpp(self) -> int:
        return len(self.counts[0])

    def stage_layers(self, pp_rank: int) -> int:
        """Decoder layers of pipeline rank `pp_rank`, over all its chunks."""
        return sum(self.counts[pp_rank])

    def chunk_order(self) -> list[int]:
        """Layers per chunk in megatron's order (chunk c = vp_stage * pp + pp_rank)."""
        return [self.counts[r][v] for v in range(self.vpp) for r in range(self.pp)]

    def first_layer(self, pp_rank: int, vp_stage: int = 0) -> int:
        """The global number (from 0) of the chunk's first decoder layer."""
        order = self.chunk_order()
        return sum(order[: vp_stage * self.pp + pp_rank])

    def megatron_layout(self) -> list[list[str]]:
        """megatron-core's `pipeline_model_parallel_layout` as a list (one entry per chunk, in
        chunk order): the embedding on the first chunk, the loss on the last."""
        order = self.chunk_order()
        layout = [["decoder"] * n for n in order]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        return layout

    def describe(self) -> str:
        """`[1, 3]`, or per chunk `[[0, 1], [1, 2]]` (stage by stage) with virtual stages."""
        if self.vpp == 1:
            return str([c[0] for c in self.counts])
        return str([list(c) for c in self.counts])


def split_layers(num_layers: int, pp: int, vpp: int = 1, pp_layers: Sequence[int] = ()) -> PipelineSplit:
    """The split megatron builds for `num_layers` decoder layers on `pp` stages of `vpp` chunks
    each: `pp_layers` (pp or pp*vpp numbers, see the module docstring), or megatron's even split
    when it is empty. Raises PipelineSplitError naming the recipe keys when megatron could not."""
    if pp < 1 or vpp < 1:
        raise PipelineSplitError(f"parallel.pp and parallel.vpp must be >= 1, got pp={pp}, vpp={vpp}")
    if vpp > 1 and pp == 1:
        raise PipelineSplitError(
            f"parallel.vpp={vpp} needs pipeline parallelism (parallel.pp > 1); virtual "
            "stages interleave the chunks of several stages"
        )
    layers = list(pp_layers)
    if not layers:
        if num_layers % (pp * vpp):
            raise PipelineSplitError(
                f"the decoder's {plural(num_layers, 'layer')} do not split evenly into pp*vpp = {pp}*{vpp} = "
                f"{pp * vpp} "
                "chunks; list the layers per stage in parallel.pp_layers (or change parallel.pp / parallel.vpp)"
            )
        n = num_layers // (pp * vpp)
        return PipelineSplit(tuple((n,) * vpp for _ in range(pp)))
    if pp == 1:
        raise PipelineSplitError(f"parallel.pp_layers={layers} needs pipeline parallelism (parallel.pp > 1)")
    if any(n < 0 for n in layers):
        raise PipelineSplitError(f"parallel.pp_layers={layers}: layer counts must be >= 0")
    if sum(layers) != num_layers:
        raise PipelineSplitError(
            f"parallel.pp_layers={layers} sums to {sum(layers)}, but the decoder has {plural(num_layers, 'layer')}"
        )
    if len(layers) == pp * vpp and vpp > 1:  # per chunk, in megatron's chunk order
        return PipelineSplit(tuple(tuple(layers[v * pp + r] for v in range(vpp)) for r in range(pp)), explicit=True)
    if len(layers) != pp:
        per_chunk = f" or pp*vpp = {pp * vpp} (layers per virtual stage)" if vpp > 1 else ""
        raise PipelineSplitError(
            f"parallel.pp_layers={layers} has {len(layers)} entries; expected pp = {pp} (layers per stage){per_chunk}"
        )
    uneven = [n for n in layers if n % vpp]
    if uneven:
        raise PipelineSplitError(
            f"parallel.pp_layers={layers}: with parallel.vpp={vpp} each stage's layers are split evenly over its "
            f"{vpp} virtual stages, and {uneven[0]} is not a multiple of {vpp}; list the layers of every virtual "
            f"stage instead ({pp * vpp} entries, chunk c = vp_stage*pp + pp_rank)"
        )
    return PipelineSplit(tuple((n // vpp,) * vpp for n in layers), explicit=True)


def balanced_layers(num_layers: int, pp: int) -> list[int]:
    """`num_layers` over `pp` stages as evenly as they go, the extra ones on the later stages (the
    first holds the embedding and any encoder): 28 over 3 -> [9, 9, 10]."""
    return [num_layers // pp + (1 if r >= pp - num_layers % pp else 0) for r in range(pp)]


def interleaved_schedule_problem(num_microbatches: int, pp: int, vpp: int) -> str | None:
    """Why megatron's interleaved schedule would refuse `num_microbatches` per step and DP rank
    (its default `microbatch_group_size_per_vp_stage` = pp: micro-batches run in groups of pp, so
    their number must be a multiple of pp), or None."""
    if vpp <= 1 or (num_microbatches >= pp and num_microbatches % pp == 0):
        return None
    return (
        f"parallel.vpp={vpp} runs megatron's interleaved schedule, which needs the micro-batches per step and "
        f"DP rank (global_batch_size / (micro_batch_size * dp) = {num_microbatches}) to be a multiple of "
        f"parallel.pp={pp}"
    )
