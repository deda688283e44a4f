"""Training in this process: one worker of a distributed job, or the whole job (a world of one,
trained in the launching process). Distributed set-up, the run's tokenizer kept with its
checkpoints, the trainer; a starting checkpoint that does not fit is a one-line user error."""

from __future__ import annotations

import logging
from pathlib import Path

from mmdata.errors import UserError
from mmdata.local_tokenizer import load_local_tokenizer
from mmtrain.config import dump_recipe, save_resolved
from mmtrain.config.schema import Recipe
from mmtrain.models.state_dict_adapter import ConversionError
from mmtrain.runtime.checkpoint.layout import checkpoints_root
from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError
from mmtrain.runtime.child_processes import forked_children_die_with_this_process
from mmtrain.runtime.cuda_settings import apply_process_env, apply_torch_flags, torch_flags
from mmtrain.runtime.distributed import UnsupportedLayout, destroy_distributed, init_distributed
from mmtrain.runtime.hf_conversion import ASSETS_DIR
from mmtrain.runtime.interrupts import saying_where_to_resume
from mmtrain.runtime.logs import setup_logging
from mmtrain.runtime.metrics import METRICS_FILE
from mmtrain.runtime.run_dir import run_dir_lock
from mmtrain.runtime.trainer import Trainer
from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


def train(recipe: Recipe, spec: FamilySpec) -> int:
    """Train in this process (one worker of a distributed job, or the whole job). A starting
    checkpoint that does not fit the recipe is a user error: one line, exit code 2. The
    run_dir is held for the whole run (`run_dir_lock`)."""
    with run_dir_lock(recipe):  # (a no-op where the launcher of this process holds it)
        return _train(recipe, spec)


def _train(recipe: Recipe, spec: FamilySpec) -> int:
    forked_children_die_with_this_process()  # loader workers, checkpoint writers: not even after kill -9
    apply_process_env(recipe.parallel.tp, recipe.train.deterministic)  # before CUDA starts
    try:
        ctx = init_distributed(recipe.parallel, seed=recipe.seed)
    except UnsupportedLayout as err:
        destroy_distributed()
        raise UserError(str(err)) from None
    apply_torch_flags(torch_flags(ctx.on_cuda, ctx.precision, recipe.train.deterministic))
    setup_logging(ctx.rank, verbose=ctx.rank == 0 or ctx.is_logging_rank)
    trainer: Trainer | None = None
    where = lambda: trainer.where() if trainer is not None else "while the run starts"  # noqa: E731
    try:
        with saying_where_to_resume(recipe.run_dir, where, say=ctx.rank == 0):  # every Ctrl-C, saves included
            if ctx.rank == 0:
                config = save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
                keep_tokenizer(recipe, spec)
                announce(recipe, config)
            trainer = Trainer(recipe, spec, ctx, dump_recipe(recipe))
            trainer.setup()
            trainer.fit()
    except (CheckpointMismatchError, ConversionError) as err:
        raise UserError(str(err)) from None
    finally:
        destroy_distributed()
    return 0


def keep_tokenizer(recipe: Recipe, spec: FamilySpec) -> Path:
    """The run's tokenizer, as its loader resolves it (the family's added tokens included), next
    to its checkpoints (`checkpoints/hf_assets/`): `mmtrain convert mcore-to-hf` exports it with the
    weights, so transformers and `mmtrain generate` load the vocabulary the model was trained on."""
    # (type checker: load_local_tokenizer names a missing path itself)
    tokenizer = load_local_tokenizer(recipe.tokenizer.path, "tokenizer.path:")  # type: ignore[arg-type]
    prepare = spec.prepare_tokenizer
    if prepare is not None:
        prepare(tokenizer)
    out = checkpoints_root(recipe.run_dir) / ASSETS_DIR
    tokenizer.save_pretrained(str(out))
    return out


def announce(recipe: Recipe, config: Path) -> None:
    """Where this run's outputs go, said once at the start."""
    run_dir = Path(recipe.run_dir).resolve()
    c = recipe.checkpoint
    every = f"every {c.interval} steps and at the end" if c.interval > 0 else "at the end"
    keep = f", keeping the last {c.keep_last}" if c.keep_last > 0 else ""
    checkpoints = (
        f"checkpoints {run_dir / 'checkpoints'}/ ({every}{keep})"
        if c.save
        else "no checkpoints (checkpoint.save: false)"
    )
    log.info(
        "run_dir %s: metrics %s, %s, resolved recipe %s", run_dir, run_dir / METRICS_FILE, checkpoints, config.resolve()
    )
