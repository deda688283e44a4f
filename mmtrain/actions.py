"""What `mmtrain train RECIPE` (and its family aliases, `mmtrain FAMILY RECIPE`) does,
by the recipe's `action:`: print the resolved recipe, dry-run, auto-tune, or hand the run to the
launcher (mmtrain/runtime/launcher.py). Outside `runtime/` because dry-run and auto-tune are
planning's, and planning builds on the runtime (never the other way round). The command's help
text and options: mmtrain/cli.py. A dry run and print_config import neither torch nor
megatron-core (seconds, not the ~40 s those take to import on a busy machine); auto-tune and
training name theirs as "module:function" and say so before importing them."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from mmdata.errors import UserError
from mmtrain import registry
from mmtrain.config import dump_recipe, load_recipe
from mmtrain.planning.dry_run import run_dry_run
from mmtrain.runtime.logs import setup_logging
from mmtrain.runtime.torchrun import launcher_world
from mmtrain.spec import resolve

log = logging.getLogger(__name__)

#: what auto-tune and training run: they import torch and megatron-core
AUTO_TUNE = "mmtrain.planning.auto_tune:run_auto_tune"
LAUNCH = "mmtrain.runtime.launcher:launch"
RUN_DIR_LOCK = "mmtrain.runtime.run_dir:run_dir_lock"


def run(args: argparse.Namespace) -> int:
    """`args.recipe`, `args.overrides`, `args.print_config`, `args.launch`; `args.alias`: the family
    subcommand it was run as (the recipe's `family:` must be that family), absent for `train`."""
    alias = getattr(args, "alias", None)
    verbose = bool(getattr(args, "verbose", False))
    setup_logging(verbose_third_party=verbose)
    recipe_path = Path(args.recipe)
    if not recipe_path.is_file():
        raise UserError(
            f"recipe {args.recipe} {'is a folder' if recipe_path.exists() else 'does not exist'}; "
            "give a YAML recipe file (see recipes/)"
        )
    overrides = [*args.overrides, *(["action=print_config"] if args.print_config else []), *launcher_world()]
    recipe = load_recipe(recipe_path, overrides, family=alias)
    spec = registry.get_family(recipe.family)
    if recipe.action == "print_config":
        print(dump_recipe(recipe), end="")
        return 0
    if recipe.action == "dry_run":
        run_dry_run(recipe, spec)  # prints the report
        return 0
    if sys.stderr.isatty() and "RANK" not in os.environ:  # a person waits; once, not per torchrun worker
        what = "auto-tune" if recipe.action == "auto_tune" else "training"
        print(
            f"mmtrain: loading torch and megatron-core for {what} (takes a while on a busy machine)...",
            file=sys.stderr,
            flush=True,
        )
    run_dir_lock, launch = resolve(RUN_DIR_LOCK), resolve(LAUNCH)
    with contextlib.ExitStack() as locks:
        if recipe.action == "auto_tune":
            locks.enter_context(run_dir_lock(recipe))  # its trials and results live in run_dir
            result = resolve(AUTO_TUNE)(recipe, spec)  # prints the summary and the best layout
            if result.exit_code or not getattr(args, "launch", False):
                return result.exit_code
            recipe = load_recipe(result.recipe_path, family=alias)
            log.info("--launch: training the best layout, %s", result.recipe_path)
        elif getattr(args, "launch", False):
            raise UserError("--launch goes with action=auto_tune (it trains the layout the search found best)")
        return launch(recipe, spec, locks, verbose)
