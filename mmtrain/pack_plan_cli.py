"""`mmtrain pack-plan RECIPE [DIR] [--set KEY=VALUE ...]`: the packing plan a recipe trains with
(`data.packing: plan`), made by mmdata's planner (`mmdata.packing.cli.make_plan`) with the
values the recipe resolves to:

- the shards: DIR, else the recipe's `data.paths[0]`; the sequence length: `train.seq_length`;
- what the samples' lengths are counted with (mmtrain/recipe_plan.py): a LLaVA-OV recipe's image
  token geometry (`model.vision` image_size / patch_size, `model.max_tiles`, `model.grid_max`,
  `data.video_frames`), an Emu3 recipe's task settings (`data.tasks`, `p_uncond`,
  `uncond_prompt`, `system_prompt`) and tokenizer (`tokenizer.path`, checked against the token
  shards' length index);
- the packing report's `parallel.cp` / `parallel.tp`;
- with `data.balance: true` (or `--dp`), vision-aware balancing for the recipe's step shape
  (`parallel.dp`, `train.micro_batch_size`, `train.global_batch_size`) at the model's tile cost
  (the cost model's FLOPs per tile over FLOPs per decoder token).

Each option of `mmdata pack-plan` overrides the recipe's value. Training refuses a plan made
with other values (mmtrain/runtime/preflight.py, `plan_packing.plan_for_data`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmdata.errors import UserError
from mmdata.packing.cli import (
    PlanRequest,
    add_plan_options,
    add_shards_dir,
    check_positive,
    geometry_flags,
    make_plan,
    step_balance,
    step_shape_flags,
)
from mmdata.packing.geometry import PlanGeometry
from mmtrain import registry
from mmtrain.config.load import load_recipe
from mmtrain.models.flops import tile_token_cost
from mmtrain.recipe_plan import recipe_geometry

HELP = "the packing plan a recipe trains with (data.packing: plan), from its shards' length index"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, metavar="RECIPE", help="an mmtrain recipe (YAML)")
    add_shards_dir(parser, "shards folder (has lengths.parquet; default: the recipe's data.paths[0])")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="a recipe override (repeatable; also as a bare KEY=VALUE), e.g. --set train.seq_length=4096",
    )
    add_plan_options(parser, recipe=True)


def run(args: argparse.Namespace) -> int:
    if args.dir is not None and "=" in str(args.dir):  # `RECIPE a.b=c`: an override, no DIR
        args.overrides, args.dir = [str(args.dir), *args.overrides], None
    recipe = load_recipe(args.recipe, list(args.overrides))
    try:
        base = recipe_geometry(recipe)
    except FileNotFoundError as e:  # its tokenizer.path
        raise UserError(f"{args.recipe}: {e}") from None
    if base is None:
        raise UserError(
            f"{args.recipe}: family {recipe.family} has nothing to plan with "
            "(pack-plan plans LLaVA-OV image shards and Emu3 token shards)"
        )
    root = args.dir if args.dir is not None else (Path(recipe.data.paths[0]) if recipe.data.paths else None)
    if root is None:
        raise UserError("give the shards folder DIR (or a recipe with data.paths)")
    seq_length = args.seq_length if args.seq_length is not None else recipe.train.seq_length
    cp = args.cp if args.cp is not None else recipe.parallel.cp
    tp = args.tp if args.tp is not None else recipe.parallel.tp
    shape, tile_tokens = step_shape_flags(args), args.tile_tokens
    if getattr(recipe.data, "balance", False) or shape["dp"] is not None:
        mine = {
            "dp": recipe.parallel.dp,
            "micro_batch_size": recipe.train.micro_batch_size,
            "global_batch_size": recipe.train.global_batch_size,
        }
        shape = {k: v if v is not None else mine[k] for k, v in shape.items()}
        if tile_tokens is None:  # (0 for a family without a vision tower: it balances on tokens alone)
            tile_tokens = tile_token_cost(registry.get_family(recipe.family).model_shapes(recipe.model))
    given = geometry_flags(args)
    check_positive({**given, "cp": cp, "tp": tp, **shape, "tile_tokens": args.tile_tokens})
    if given and not isinstance(base, PlanGeometry):
        raise UserError(
            f"--{next(iter(given)).replace('_', '-')}: image geometry options do not apply to the "
            f"recipe's family ({recipe.family})"
        )
    geometry = PlanGeometry(**{**base.as_dict(), **given}) if given else base
    make_plan(
        PlanRequest(
            root,
            seq_length,
            geometry,
            recipe.tokenizer.path,
            cp or 1,
            tp or 1,
            step_balance(shape, tile_tokens),
            args.seed,
            args.jobs,
            not args.no_progress,
        )
    )
    return 0
