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


def tp_valid(L: Layout, c: SpaceContext) -> bool:
    """TP splits heads, KV groups and FFN of every tower it shards (the encoder's with its
    layout inherited), and stays inside a node."""
    d, v = c.shapes.decoder, c.shapes.encoder
    ok = d.heads % L.tp == 0 and d.kv_groups % L.tp == 0 and d.ffn % L.tp == 0
    ok = ok and (v is None or L.vision_tp is not None or (v.heads % L.tp == 0 and v.ffn % L.tp == 0))
    return ok and c.recipe.parallel.nproc_per_node % L.tp == 0


def pipeline_split_valid(L: Layout, c: SpaceContext) -> bool:
    """megatron can cut the decoder into the layout's stages and virtual stages (the recipe's
    `parallel.pp_layers` where they fit it, else an even split: `fit_recipe_split`)."""
    try:
        L.split(c.shapes.decoder.layers)
    except PipelineSplitError:
        return False
    return True


def vpp_valid(L: Layout, c: SpaceContext) -> bool:
    """Virtual stages need pipelining and micro-batches per DP rank in groups of pp (megatron's
    interleaved schedule)."""
    return L.vpp == 1 or (L.pp > 1 and interleaved_schedule_problem(L.grad_accum, L.pp, L.vpp) is None)


def fit_recipe_split(L: Layout, c: SpaceContext) -> Layout:
    """The recipe's `parallel.pp_layers` for a layout it fits (its pp and vpp), else the even split."""
    if not L.pp_layers or pipeline_split_valid(L, c):
        return L
    return L.with_(pp_layers=())


def vision_tp_valid(L: Layout, c: SpaceContext) -> bool:
    """The encoder's own TP is 1 or the decoder's (models/encoder_parallel.py), and only where
    some ranks share a micro-batch (else it is the inherited layout under another name)."""
    if L.vision_tp is None:
        return True
    v = c.shapes.encoder
    return (v is not None and L.vision_tp in (1, L.tp) and L.tp * L.cp > 1
            and (L.vision_tp == 1 or (v.heads % L.tp == 0 and v.ffn % L.tp == 0)))


def recompute_memory_rank(L: Layout) -> float:
    """Recompute modes by the activations they keep: none 2, selective 1 (all but the attention
    internals), full below that: 1 / (1 + N) when only N layers of a stage are, 0 when all are
    (fewer recomputed layers keep more activations)."""
    if L.recompute != "full":
        return {"none": 2.0, "selective": 1.0}[L.recompute]
    return 1.0 / (1 + L.recompute_num_layers) if L.recompute_num_layers else 0.0


@dataclass(frozen=True)
class Dimension:
    name: str  # the Layout field and the auto_tune: list key
    recipe_key: str  # dotted recipe key the value goes to in best.yaml and the trial recipes
    auto: Callable[[SpaceContext], list[Any]]
    splits_world: bool = False
    valid: Callable[[Layout, SpaceContext], bool] = lambda L, c: True
    # for pruning by history: a number that grows with the memory the layout needs through this
    # dimension (None: not ordered, so an OOM says nothing about other values of it)
    memory_order: Callable[[Layout], float] | None = None


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("tp", "parallel.tp", splits_world=True, auto=lambda c: divisors(c.recipe.parallel.nproc_per_node),
              valid=tp_valid),
    Dimension("pp", "parallel.pp", splits_world=True, auto=lambda c: divisors(c.shapes.decoder.layers),
              valid=pipeline_split_valid),
    # interleaved 1F1B: a smaller bubble, more in-flight activations (not monotone in vpp: unordered)
    Dimension("vpp", "parallel.vpp", auto=lambda c: [v for v in divisors(c.shapes.decoder.layers) if v <= MAX_AUTO_VPP],
              valid=vpp_valid),
    # CP cuts every sequence into 2*cp chunks (2*cp*tp with sequence parallelism)
    Dimension("cp", "parallel.cp", splits_world=True, auto=lambda c: divisors(c.world),
              valid=lambda L, c: c.seq_length % sequence_split_multiple(L.cp, L.tp, L.sequence_parallel) == 0),
    Dimension("micro_batch_size", "train.micro_batch_size",
              auto=lambda c: [m for m in divisors(c.recipe.train.global_batch_size) if m <= MAX_AUTO_MICRO_BATCH],
              memory_order=lambda L: L.micro_batch_size),
    Dimension("recompute", "parallel.recompute", auto=lambda c: list(RECOMPUTE_MODES),
              memory_order=lambda L: recompute_memory_rank(L)),
    Dimension("recompute_num_layers", "parallel.recompute_num_layers",
              auto=lambda c: sorted({0, c.shapes.decoder.layers // 4, c.shapes.decoder.layers // 2}),
              valid=lambda L, c: L.recompute_num_layers == 0 or (  # megatron counts them per model chunk
                  L.recompute == "full" and L.recompute_num_layers < c.shapes.decoder.layers // (L.pp * L.vpp)),
              memory_order=lambda L: 0.0),  # ordered together with recompute (recompute_memory_rank)
    Dimension("sequence_parallel", "parallel.sequence_parallel", auto=lambda c: [False, True],
              valid=lambda L, c: L.tp > 1 or not L.sequence_parallel,  # SP only splits over TP
              memory_order=lambda L: not L.sequence_parallel),
    Dimension("distributed_optimizer", "parallel.distributed_optimizer",
              auto=lambda c: [True, False] if c.on_cuda else [c.recipe.parallel.distributed_optimizer],
              valid=lambda L, c: L.dp > 1 or L.distributed_optimizer == c.recipe.parallel.distributed_optimizer,
              memory_order=lambda L: not L.distributed_optimizer),
    # the vision tower's own layout: None (the decoder's) or 1 (whole per rank, tiles split over TP x CP)
    Dimension("vision_tp", "parallel.vision.tp", auto=lambda c: [None, 1] if c.shapes.encoder is not None else [None],
              valid=vision_tp_valid),
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
    short = {"micro_batch_size": "mbs", "recompute": "rc", "recompute_num_layers": "rcl", "sequence_parallel": "sp",
             "distributed_optimizer": "do", "vision_tp": "vtp"}
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
