"""The auto-tune search space, written as data: one `Dimension` per tunable knob.

Each dimension names the `Layout` field it varies (also its `auto_tune:` list key) and the recipe
key a chosen value is written to; its values are the recipe's `auto_tune.<name>` list, or, when
that is empty, `auto(ctx)` (derived from the world size and the model's shapes). Dimensions with
`splits_world` are model-parallel sizes: dp is the world size divided by their product. A layout
is a candidate only when every dimension's `valid` accepts it and the world and the global batch
divide (what megatron accepts).

Adding a dimension is one entry in `DIMENSIONS` (plus its `Layout` field, `auto_tune:` list key
and, where the cost model should see it, its term there), as context parallelism's `cp` and the
vision tower's own layout `vision_tp` are.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable

from mmtrain.config.schema import RECOMPUTE_MODES, Recipe
from mmtrain.models.pipeline_split import PipelineSplitError, interleaved_schedule_problem
from mmtrain.models.layout_rules import sequence_split_multiple
from mmtrain.models.shapes import ModelShapes
from mmtrain.planning.cost_model import Layout

MAX_AUTO_MICRO_BATCH = 64
MAX_AUTO_VPP = 4  # auto: 1, 2, 4 virtual stages where the layers split (megatron-LM runs use a few)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SpaceContext:
    """What `auto` and `valid` may look at."""

    recipe: Recipe
    shapes: ModelShapes
    on_cuda: bool  # trials run on GPUs (NCCL) rather than CPU processes (gloo)

    @property
    def world(self) -> int:
        return self.recipe.parallel.world_size

    @property
    def seq_length(self) -> int:
        return self.recipe.train.seq_length


def tp_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """TP splits heads, KV groups and FFN of every tower it shards (the encoder's with its
    layout inherited), and stays inside a node."""
    d, v = ctx.shapes.decoder, ctx.shapes.encoder
    ok = d.heads % layout.tp == 0 and d.kv_groups % layout.tp == 0 and d.ffn % layout.tp == 0
    ok = ok and (v is None or layout.vision_tp is not None or (v.heads % layout.tp == 0 and v.ffn % layout.tp == 0))
    return ok and ctx.recipe.parallel.nproc_per_node % layout.tp == 0


def pipeline_split_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """megatron can cut the decoder into the layout's stages and virtual stages (the recipe's
    `parallel.pp_layers` where they fit it, else an even split: `fit_recipe_split`)."""
    try:
        layout.split(ctx.shapes.decoder.layers)
    except PipelineSplitError:
        return False
    return True


def vpp_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """Virtual stages need pipelining and micro-batches per DP rank in groups of pp (megatron's
    interleaved schedule)."""
    return layout.vpp == 1 or (
        layout.pp > 1 and interleaved_schedule_problem(layout.grad_accum, layout.pp, layout.vpp) is None
    )


def fit_recipe_split(layout: Layout, ctx: SpaceContext) -> Layout:
    """The recipe's `parallel.pp_layers` for a layout it fits (its pp and vpp), else the even split."""
    if not layout.pp_layers or pipeline_split_valid(layout, ctx):
        return layout
    return layout.with_(pp_layers=())


def vision_tp_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """The encoder's own TP is 1 or the decoder's (models/encoder_parallel.py), and only where
    some ranks share a micro-batch (else it is the inherited layout under another name)."""
    if layout.vision_tp is None:
        return True
    v = ctx.shapes.encoder
    return (
        v is not None
        and layout.vision_tp in (1, layout.tp)
        and layout.tp * layout.cp > 1
        and (layout.vision_tp == 1 or (v.heads % layout.tp == 0 and v.ffn % layout.tp == 0))
    )


def recompute_memory_rank(layout: Layout) -> float:
    """Recompute modes by the activations they keep: none 2, selective 1 (all but the attention
    internals), full below that: 1 / (1 + N) when only N layers of a stage are, 0 when all are
    (fewer recomputed layers keep more activations)."""
    if layout.recompute != "full":
        return {"none": 2.0, "selective": 1.0}[layout.recompute]
    return 1.0 / (1 + layout.recompute_num_layers) if layout.recompute_num_layers else 0.0


def cp_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """CP cuts every sequence into 2*cp chunks (2*cp*tp with sequence parallelism)."""
    return ctx.seq_length % sequence_split_multiple(layout.cp, layout.tp, layout.sequence_parallel) == 0


def recompute_layers_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """A count of recomputed layers only with full recompute, below a model chunk's layers (megatron
    counts them per model chunk)."""
    return layout.recompute_num_layers == 0 or (
        layout.recompute == "full"
        and layout.recompute_num_layers < ctx.shapes.decoder.layers // (layout.pp * layout.vpp)
    )


def sequence_parallel_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """SP only splits over TP."""
    return layout.tp > 1 or not layout.sequence_parallel


def distributed_optimizer_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """The distributed optimizer shards over DP: with one DP rank only the recipe's own choice is kept."""
    return layout.dp > 1 or layout.distributed_optimizer == ctx.recipe.parallel.distributed_optimizer


def always_valid(layout: Layout, ctx: SpaceContext) -> bool:
    """The default: every value of the dimension goes with every layout."""
    return True


@dataclass(frozen=True)
class Dimension:
    name: str  # the Layout field and the auto_tune: list key
    recipe_key: str  # dotted recipe key the value goes to in best.yaml and the trial recipes
    auto: Callable[[SpaceContext], list[Any]]
    splits_world: bool = False
    valid: Callable[[Layout, SpaceContext], bool] = always_valid
    # for pruning by history: a number that grows with the memory the layout needs through this
    # dimension (None: not ordered, so an OOM says nothing about other values of it)
    memory_order: Callable[[Layout], float] | None = None


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "tp",
        "parallel.tp",
        splits_world=True,
        auto=lambda ctx: divisors(ctx.recipe.parallel.nproc_per_node),
        valid=tp_valid,
    ),
    Dimension(
        "pp",
        "parallel.pp",
        splits_world=True,
        auto=lambda ctx: divisors(ctx.shapes.decoder.layers),
        valid=pipeline_split_valid,
    ),
    # interleaved 1F1B: a smaller bubble, more in-flight activations (not monotone in vpp: unordered)
    Dimension(
        "vpp",
        "parallel.vpp",
        auto=lambda ctx: [v for v in divisors(ctx.shapes.decoder.layers) if v <= MAX_AUTO_VPP],
        valid=vpp_valid,
    ),
    # CP cuts every sequence into 2*cp chunks (2*cp*tp with sequence parallelism)
    Dimension("cp", "parallel.cp", splits_world=True, auto=lambda ctx: divisors(ctx.world), valid=cp_valid),
    Dimension(
        "micro_batch_size",
        "train.micro_batch_size",
        auto=lambda ctx: [m for m in divisors(ctx.recipe.train.global_batch_size) if m <= MAX_AUTO_MICRO_BATCH],
        memory_order=lambda layout: layout.micro_batch_size,
    ),
    Dimension(
        "recompute", "parallel.recompute", auto=lambda ctx: list(RECOMPUTE_MODES), memory_order=recompute_memory_rank
    ),
    Dimension(
        "recompute_num_layers",
        "parallel.recompute_num_layers",
        auto=lambda ctx: sorted({0, ctx.shapes.decoder.layers // 4, ctx.shapes.decoder.layers // 2}),
        valid=recompute_layers_valid,
        memory_order=lambda layout: 0.0,
    ),  # ordered together with recompute (recompute_memory_rank)
    Dimension(
        "sequence_parallel",
        "parallel.sequence_parallel",
        auto=lambda ctx: [False, True],
        valid=sequence_parallel_valid,
        memory_order=lambda layout: not layout.sequence_parallel,
    ),
    Dimension(
        "distributed_optimizer",
        "parallel.distributed_optimizer",
        auto=lambda ctx: [True, False] if ctx.on_cuda else [ctx.recipe.parallel.distributed_optimizer],
        valid=distributed_optimizer_valid,
        memory_order=lambda layout: not layout.distributed_optimizer,
    ),
    # the vision tower's own layout: None (the decoder's) or 1 (whole per rank, tiles split over TP x CP)
    Dimension(
        "vision_tp",
        "parallel.vision.tp",
        auto=lambda ctx: [None, 1] if ctx.shapes.encoder is not None else [None],
        valid=vision_tp_valid,
    ),
)


def dimension_values(dim: Dimension, ctx: SpaceContext) -> list[Any]:
    """The recipe's `auto_tune.<name>` list, else the dimension's auto values."""
    return list(getattr(ctx.recipe.auto_tune, dim.name, None) or dim.auto(ctx))


def candidate_layouts(ctx: SpaceContext, dims: tuple[Dimension, ...] = DIMENSIONS) -> list[Layout]:
    """Every layout of the Cartesian product that megatron accepts, in product order, unique."""
    base = Layout.from_recipe(ctx.recipe)
    gbs = ctx.recipe.train.global_batch_size
    out: dict[Layout, None] = {}
    for values in itertools.product(*(dimension_values(d, ctx) for d in dims)):
        chosen = dict(zip((d.name for d in dims), values))
        model_parallel = math.prod(chosen[d.name] for d in dims if d.splits_world)
        if ctx.world % model_parallel:
            continue
        layout = fit_recipe_split(base.with_(dp=ctx.world // model_parallel, **chosen), ctx)
        if gbs % (layout.micro_batch_size * layout.dp):
            continue
        if all(d.valid(layout, ctx) for d in dims):
            out[layout] = None
    return list(out)


def needs_more_memory(a: Layout, b: Layout, dims: tuple[Dimension, ...] = DIMENSIONS) -> bool:
    """`a` needs at least the memory of `b` by construction: the same in every unordered dimension
    and at least as memory-hungry in every ordered one (larger micro-batch, less recompute,
    no sequence parallelism, no optimizer sharding). After `b` ran out of memory, `a` would too."""
    for d in dims:
        if d.memory_order is None:
            if getattr(a, d.name) != getattr(b, d.name):
                return False
        elif d.memory_order(a) < d.memory_order(b):
            return False
    return True


def layout_values(layout: Layout, dims: tuple[Dimension, ...] = DIMENSIONS) -> dict[str, Any]:
    """The tuned values of a layout, by dimension name (dp included: it is derived but telling)."""
    values = {d.name: getattr(layout, d.name) for d in dims}
    return {**values, "dp": layout.dp}


def layout_key(layout: Layout, dims: tuple[Dimension, ...] = DIMENSIONS) -> str:
    """A stable text key of a layout's tuned values (history rows, trial folder names)."""
    short = {
        "micro_batch_size": "mbs",
        "recompute": "rc",
        "recompute_num_layers": "rcl",
        "sequence_parallel": "sp",
        "distributed_optimizer": "do",
        "vision_tp": "vtp",
    }
    parts = []
    for name, value in layout_values(layout, dims).items():
        text = str(int(value)) if isinstance(value, bool) else "lm" if value is None else str(value)
        parts.append(f"{short.get(name, name)}{text}")
    return "-".join(parts)


def apply_layout(recipe: Recipe, layout: Layout, dims: tuple[Dimension, ...] = DIMENSIONS) -> Recipe:
    """The recipe with the layout's values at each dimension's recipe key, and its decoder split
    (the recipe's `parallel.pp_layers`, or [] where they do not fit the layout)."""
    for d in dims:
        recipe = set_key(recipe, d.recipe_key, getattr(layout, d.name))
    return set_key(recipe, "parallel.pp_layers", list(layout.pp_layers))


def set_key(obj: Any, dotted: str, value: Any) -> Any:
    """A copy of the dataclass tree `obj` with `dotted` (e.g. "parallel.tp") set to `value`."""
    head, _, rest = dotted.partition(".")
    if head not in {f.name for f in fields(obj)}:
        raise KeyError(f"{type(obj).__name__} has no field {head!r} (from {dotted!r})")
    new = set_key(getattr(obj, head), rest, value) if rest else value
    return dataclasses.replace(obj, **{head: new})
