"""`mmdata pack-plan DIR --seq-length N`: a deterministic global packing plan from the length
index, so a loader can pack exactly and reproducibly, independent of any buffer size
(algorithm.py; the file: plan_file.py, docs/preprocess.md "Packing plan").

The length index counts with LLaVA-OV's own geometry (729 tokens per 384-px tile); the geometry
flags plan for another vision tower: the image tokens are then recounted from the records' image
header sizes, the text tokens kept. Training refuses a plan whose geometry differs from the
recipe's (`plan_packing.plan_for_data`). Emu3 token shards (`mmdata tokenize-images --tokenizer`)
are planned with Emu3's default task settings here (emu3.py); `mmtrain pack-plan RECIPE.yaml`
plans with a recipe's settings, geometry, sequence length and step shape, through `make_plan`.
The output line and the metadata (`lengths_estimated`) say whether the text lengths are exact
(`mmdata preprocess --tokenizer`) or estimates, which training refuses unless the recipe opts in.
The metadata's `packing_report` (also printed) holds the plan's bin fill and executed-token
efficiency at `--cp`/`--tp`, CP padding counted as the runtime pads (packing/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmdata.errors import UserError
from mmdata.packing.algorithm import plan_packing
from mmdata.packing.balance import DEFAULT_TILE_TOKENS, StepShape
from mmdata.packing.emu3 import token_plan_inputs
from mmdata.packing.emu3_geometry import Emu3PlanGeometry, index_meta
from mmdata.packing.geometry import DEFAULT_GEOMETRY, GEOMETRY_FIELDS, PlanGeometry
from mmdata.packing.inputs import image_plan_inputs, read_lengths
from mmdata.packing.plan_file import plan_path, replaced_settings, write_plan
from mmdata.shard_job.lengths import LENGTHS_NAME
from mmdata.shard_job.progress import JobProgress
from mmdata.shard_job.shard_writer import sha256_file
from mmdata.readiness import unfinished_job
from mmdata.shard_format import MANIFEST_NAME
from mmdata.units import plural

RECIPE_COMMAND = "mmtrain pack-plan RECIPE.yaml [DIR] [--set KEY=VALUE ...]"
#: the output line's note on a plan of estimated text lengths (its metadata: `lengths_estimated`)
ESTIMATED_NOTE = (
    "text lengths are ESTIMATES (shards preprocessed without --tokenizer): rows will overflow; "
    "training refuses this plan unless data.plan_allow_estimated_lengths: true"
)


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan depends on, explicit: what `mmdata pack-plan`'s flags or an mmtrain recipe say."""

    root: Path
    seq_length: int
    geometry: PlanGeometry | Emu3PlanGeometry | None = None  # None: what the length index counted with
    tokenizer: str | Path | None = None  # Emu3: the text tokenizer that counts the unconditional prompt
    cp: int = 1  # the packing report's context and tensor parallel sizes (the plan does not depend on them)
    tp: int = 1
    balance: tuple[StepShape, float] | None = None  # (step shape, tile cost) to balance for
    seed: int = 0
    jobs: int | None = None  # processes (None: all CPUs); the plan does not depend on it
    progress: bool = True


def make_plan(req: PlanRequest) -> Path:
    """Plan `req.root`'s length index, write the plan file and print its summary lines."""
    if req.seq_length <= 0:
        raise UserError(f"--seq-length must be positive, got {req.seq_length}")
    if req.jobs is not None and req.jobs <= 0:
        raise UserError(f"--jobs must be positive, got {req.jobs}")
    if (why := unfinished_job(req.root)) is not None:
        raise UserError(why)
    try:
        table = read_lengths(req.root)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    manifest = json.loads((req.root / MANIFEST_NAME).read_text()) if (req.root / MANIFEST_NAME).is_file() else {}
    with _Stages(enabled=req.progress) as progress:
        if index_meta(table).get("kind") is not None:  # token shards (mmdata tokenize-images --tokenizer)
            inputs = token_plan_inputs(req.root, table, req.geometry, req.tokenizer, req.seed)
        else:
            inputs = image_plan_inputs(req.root, table, req.geometry, on_shard=progress.step("recount shards"))
        plan = plan_packing(
            inputs.lengths,
            req.seq_length,
            req.seed,
            req.jobs or os.cpu_count() or 1,
            on_chunk=progress.step("pack chunks"),
        )
    estimated = inputs.meta.get("text_tokens") == "estimate"  # shards preprocessed without --tokenizer
    meta = {
        "lengths_sha256": sha256_file(req.root / LENGTHS_NAME),
        "manifest_fingerprint": manifest.get("fingerprint"),
        **inputs.meta,
        "lengths_estimated": estimated,
        "geometry": inputs.geometry.as_dict(),
    }
    balance_line = None
    if req.balance is not None:
        shape, tile_tokens = req.balance
        today = plan.vision_balance(inputs.tiles, shape, tile_tokens, balanced=False)
        plan = plan.balanced(inputs.tiles, shape, tile_tokens, req.seed)
        after = plan.vision_balance(inputs.tiles, shape, tile_tokens, balanced=True)
        meta["balance"] = {**shape.as_dict(), "tile_tokens": tile_tokens}
        meta["vision_balance"] = {"today": today.as_dict(), "balanced": after.as_dict()}
        balance_line = (
            f"vision balance ({shape.describe()}; max/mean vision work per rank per step): "
            f"today {today.line()} -> balanced {after.line()}"
        )
    report = plan.report(req.cp, req.tp)
    meta["packing_report"] = report.as_dict()
    replaced = replaced_settings(plan_path(req.root, req.seq_length), {**meta, "seed": req.seed})
    out = write_plan(
        req.root, plan, inputs.index, req.seed, meta, {"tiles": inputs.tiles.astype(np.int32), **(inputs.columns or {})}
    )
    print(
        f"{out}: {plural(len(plan.bins), 'sequence')} of {req.seq_length:,} tokens for "
        f"{plural(len(inputs.lengths), 'sample')}, "
        f"efficiency {plan.efficiency:.2%} ({plan.over_length:,} over length); {inputs.summary}; "
        f"{ESTIMATED_NOTE if estimated else 'exact text lengths'}"
    )
    print(f"packing report: {report.line()}")
    if replaced:  # one plan per sequence length: the loader reads pack-plan-<seq_length>.parquet
        print(f"replaced {out.name}, a plan made with other settings: {'; '.join(replaced)}")
    if balance_line is not None:
        print(balance_line)
    return out


class _Stages:
    """Live progress of pack-plan's stages (the job's own progress display, one bar each)."""

    def __init__(self, enabled: bool):
        self.job = JobProgress(enabled)

    def __enter__(self) -> _Stages:
        self.job.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.__exit__(*exc)

    def step(self, name: str) -> Callable[[int], None]:
        """A callback advancing stage `name` by one of `total` (the stage starts at its first call)."""

        def advance(total: int) -> None:
            if name not in self.job.tasks:
                self.job.stage(name, total)
            self.job.advance(name)

        return advance


# ----------------------------------------------------------------------------- options


def add_plan_options(parser: argparse.ArgumentParser, recipe: bool) -> None:
    """The options `mmdata pack-plan` and `mmtrain pack-plan` share (`recipe`: defaults from a recipe)."""

    def default(of_recipe: str, plain: str) -> str:
        return of_recipe if recipe else plain

    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per packed sequence ({default('default: the recipe train.seq_length', 'required')})",
    )
    for name in GEOMETRY_FIELDS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            metavar="N",
            help=f"image geometry: {name} (default: "
            f"{default('the recipe value', str(getattr(DEFAULT_GEOMETRY, name)))})",
        )
    for name, what in (("cp", "context"), ("tp", "tensor")):
        parser.add_argument(
            f"--{name}",
            type=int,
            default=None,
            metavar="N",
            help=f"{what} parallel size the packing report counts CP padding for (default: "
            f"{default(f'the recipe parallel.{name}', '1')}); the plan does not depend on it",
        )
    for name, what in (
        ("dp", "data-parallel ranks"),
        ("micro_batch_size", "rows per micro-batch (default 1)"),
        ("global_batch_size", "rows per step, all ranks"),
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            metavar="N",
            help=f"vision-aware balancing for training at this step shape: {what} (default: "
            f"{default('the recipe values when its data.balance is true; else ', '')}"
            "no balancing)",
        )
    parser.add_argument(
        "--tile-tokens",
        type=float,
        default=None,
        metavar="X",
        help="the cost of one vision tile in language tokens for balancing (default: "
        f"{default('the recipe model value, from the cost model', '')}"
        f"{'' if recipe else f'{DEFAULT_TILE_TOKENS:g}, the Aquila-VL-2B value'})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples' order (default 0)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="processes (default: all CPUs); the plan does not depend on it"
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress display on stderr")


def check_positive(asked: dict[str, float | None]) -> None:
    """Refuse a non-positive size among the asked options (None: not given)."""
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in asked.items() if v is not None and v <= 0]
    if bad:
        raise UserError(f"{', '.join(bad)}: must be positive")


def step_balance(shape: dict, tile_tokens: float | None) -> tuple[StepShape, float] | None:
    """The step shape and tile cost to balance for, from --dp/--micro-batch-size/--global-batch-size
    (--dp and --global-batch-size go together; the micro-batch defaults to 1)."""
    if shape["dp"] is None and shape["global_batch_size"] is None:
        if shape["micro_batch_size"] is not None or tile_tokens is not None:
            raise UserError(
                "--micro-batch-size/--tile-tokens balance a plan for a step shape: give --dp and "
                "--global-batch-size with them"
            )
        return None
    if shape["dp"] is None or shape["global_batch_size"] is None:
        raise UserError(
            "vision-aware balancing needs the step shape: give --dp N and --global-batch-size N "
            "(and --micro-batch-size N, default 1), or use `mmtrain pack-plan RECIPE.yaml` with "
            "data.balance: true"
        )
    try:
        step = StepShape(shape["dp"], shape["micro_batch_size"] or 1, shape["global_batch_size"])
    except ValueError as e:
        raise UserError(f"--dp/--micro-batch-size/--global-batch-size: {e}") from None
    return step, float(tile_tokens if tile_tokens is not None else DEFAULT_TILE_TOKENS)


def geometry_flags(args: argparse.Namespace) -> dict[str, int]:
    """The geometry options given."""
    return {k: getattr(args, k) for k in GEOMETRY_FIELDS if getattr(args, k) is not None}


def step_shape_flags(args: argparse.Namespace) -> dict[str, int | None]:
    return {k: getattr(args, k) for k in ("dp", "micro_batch_size", "global_batch_size")}


# ----------------------------------------------------------------------------- `mmdata pack-plan`


def add_shards_dir(parser: argparse.ArgumentParser, help: str) -> None:
    """The optional DIR positional: the shards folder to plan."""
    parser.add_argument("dir", type=Path, metavar="DIR", nargs="?", default=None, help=help)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shards_dir(
        parser,
        "shards folder written by `mmdata preprocess` or `mmdata tokenize-images --tokenizer` (has lengths.parquet)",
    )
    add_plan_options(parser, recipe=False)
    # mmdata reads no recipe: these only say where planning from a recipe went
    parser.add_argument("--recipe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], dest="overrides", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.recipe is not None:
        raise UserError(f"--recipe {args.recipe}: mmdata reads no recipe; plan from a recipe with `{RECIPE_COMMAND}`")
    if args.overrides:
        raise UserError(
            f"--set {' '.join(args.overrides)}: recipe overrides need --recipe, which mmdata does not "
            f"take: plan from a recipe with `{RECIPE_COMMAND}`"
        )
    if args.dir is None:
        raise UserError("give the shards folder DIR")
    if args.seq_length is None:
        raise UserError(f"give --seq-length N (or plan from a recipe's train.seq_length with `{RECIPE_COMMAND}`)")
    given, shape = geometry_flags(args), step_shape_flags(args)
    check_positive({**given, "cp": args.cp, "tp": args.tp, **shape, "tile_tokens": args.tile_tokens})
    geometry = PlanGeometry(**{**DEFAULT_GEOMETRY.as_dict(), **given}) if given else None
    make_plan(
        PlanRequest(
            args.dir,
            args.seq_length,
            geometry,
            None,
            args.cp or 1,
            args.tp or 1,
            step_balance(shape, args.tile_tokens),
            args.seed,
            args.jobs,
            not args.no_progress,
        )
    )
    return 0
