"""mmtrain: train multimodal model families on megatron-core from YAML recipes.

  mmtrain train RECIPE [a.b=c ...]      train, dry-run, auto-tune or print the resolved recipe; the
                                        recipe's `family:` picks the model family
  mmtrain FAMILY RECIPE [a.b=c ...]     the same, for a recipe of that family ({families})
  mmtrain convert hf-to-mcore ...       HF -> megatron checkpoint
  mmtrain convert mcore-to-hf ...       megatron -> HF checkpoint
  mmtrain generate FAMILY ...           generate from a checkpoint (the families: {generators})
  mmtrain worst-samples RUN_DIR ...     the highest-loss samples of a training step
  mmtrain pack-plan RECIPE [DIR] ...    the packing plan a recipe trains with (data.packing: plan)

`mmtrain COMMAND --help` describes each command and its options; docs/ has the how-tos.
Exit status: 0 done; 2 an expected problem (an invalid recipe, a missing path, a checkpoint of
another model), said in one line before anything is written; 130 interrupted (Ctrl-C); 1 an
unexpected error, whose traceback goes to a log file named on stderr (--verbose prints it).
"""

from __future__ import annotations

import argparse
import os
import sys

import mmtrain
from mmdata.errors import HintingParser, add_common_options, run_main
from mmtrain import convert, pack_plan_cli, registry
from mmtrain import generate_cli as generation_cli
from mmtrain.runtime import metrics
from mmtrain.runtime.logs import quiet_third_party
from mmtrain.spec import resolve

RAW = argparse.RawDescriptionHelpFormatter

#: `mmtrain train --help` (COMMAND: "train" or a family alias)
TRAIN_HELP = """Train (or dry-run / auto-tune) a model from a YAML recipe (keys: docs/recipes.md).

  mmtrain COMMAND RECIPE [a.b.c=value ...]        e.g. train.iters=100 "data.paths=[/data/s2]"
  mmtrain COMMAND RECIPE --print-config           the resolved recipe, nothing run

The recipe's `family:` picks the model family ({families}); `mmtrain FAMILY RECIPE` is the same
command, refusing a recipe of another family. The recipe is validated (every problem at once,
each naming its key) and the overrides applied (written `a.b.c=value`, without dashes). Then, by
`action:`:
  run          - check what the run will touch (data paths, tokenizer, the run dir's
                 checkpoints: mmtrain/runtime/preflight.py), write the resolved recipe to
                 `<run_dir>/config.yaml` (absolute paths) and train. Inside torchrun
                 (RANK/WORLD_SIZE set) or a SLURM step with one task per process, this process
                 is one worker (srun: the rendezvous comes from the allocation, see
                 mmtrain/runtime/slurm.py). Otherwise, when parallel.nproc_per_node x parallel.nnodes > 1,
                 the workers are started here with torchrun (run the same command on every node
                 with its parallel.node_rank=K); a world of one trains in this process.
  dry_run      - print parameter counts and the per-rank memory estimate (nothing is built)
  auto_tune    - search parallel layouts: prune with the cost model, run short trials of the real
                 job on the survivors, write run_dir/auto_tune/{{history.csv,best.yaml}};
                 exits 1 when no layout fits or none ran (--launch: then train best.yaml)
  print_config - print the resolved recipe (as --print-config) and exit

Exit status: 0 done, 2 a problem with the recipe or what it points at (one message, nothing
written), 130 interrupted, 1 an unexpected error (its traceback in a log file, or on stderr
with --verbose).
"""

#: what `mmtrain train` and its family aliases run, imported at dispatch (it imports the runtime)
TRAIN_ACTION = "mmtrain.actions:run"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/ and docs/recipes.md)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="recipe overrides, e.g. train.iters=10 (no leading dashes); a value is YAML",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved recipe (stage, overrides and defaults applied) and exit; "
        "the same as action=print_config",
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="with action=auto_tune: train the best layout (run_dir/auto_tune/best.yaml) right after the search",
    )


def _train_parser(sub: argparse._SubParsersAction, command: str, help: str, alias: str | None) -> None:
    families = ", ".join(registry.family_names())
    p = sub.add_parser(
        command,
        help=help,
        formatter_class=RAW,
        description=TRAIN_HELP.format(families=families).replace("COMMAND", command).strip(),
    )
    add_train_arguments(p)
    add_common_options(p)
    p.set_defaults(run=TRAIN_ACTION, alias=alias)


def build_parser() -> argparse.ArgumentParser:
    generators = ", ".join(spec.name for spec in registry.FAMILIES.values() if spec.generation is not None)
    description = __doc__.format(families=", ".join(registry.family_names()), generators=generators)
    parser = HintingParser(prog="mmtrain", description=description, formatter_class=RAW)
    add_common_options(parser, version=mmtrain.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub, "train", "train a model from a YAML recipe (its family: picks the model)", None)
    for spec in registry.FAMILIES.values():
        _train_parser(sub, spec.name, f"train {spec.help} from a YAML recipe", spec.name)
    p = sub.add_parser(
        "convert",
        help="convert checkpoints between HF and megatron formats",
        description=(convert.__doc__ or "").strip(),
        formatter_class=RAW,
    )
    convert.add_arguments(p, add_common_options)
    p = sub.add_parser(
        "generate",
        help=f"generate from a checkpoint ({generators})",
        description=generation_cli.generate_help(),
        formatter_class=RAW,
    )
    generation_cli.add_arguments(p, add_common_options)
    p = sub.add_parser(
        "worst-samples",
        help="print the samples of a training step ranked by their loss",
        description=metrics.WORST_SAMPLES_HELP,
        formatter_class=RAW,
    )
    metrics.add_arguments(p)
    add_common_options(p)
    p.set_defaults(run=metrics.run)
    p = sub.add_parser("pack-plan", help=pack_plan_cli.HELP, description=pack_plan_cli.__doc__, formatter_class=RAW)
    pack_plan_cli.add_arguments(p)
    add_common_options(p)
    p.set_defaults(run=pack_plan_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network at run time: local paths never reach the hub
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):  # `RECIPE --print-config a.b=c`: overrides after an option too
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if x not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    prog = " ".join(
        ["mmtrain", args.command] + [getattr(args, sub) for sub in ("direction", "family") if getattr(args, sub, None)]
    )
    return run_main(prog, args, dispatch)


def dispatch(args: argparse.Namespace) -> int | None:
    """Run the parsed command. A "module:function" command (training, generation) is imported
    here, after third-party warnings are hidden (unless --verbose): megatron warns at import."""
    command = args.run
    if isinstance(command, str):
        if not getattr(args, "verbose", False):
            quiet_third_party()
        command = resolve(command)
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
