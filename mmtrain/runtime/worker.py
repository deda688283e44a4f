"""Worker entry point started by `mmtrain FAMILY RECIPE` through torchrun:

    python -m torch.distributed.run ... -m mmtrain.runtime.worker RUN_DIR/config.yaml

The `__main__` guard matters: megatron's dist-checkpointing writer starts a `spawn`
multiprocessing manager, which re-imports the main module.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from mmtrain.config import RecipeError, load_recipe
    from mmtrain.runtime.launch import setup_logging, train

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m mmtrain.runtime.worker RESOLVED_RECIPE [KEY=VALUE ...]", file=sys.stderr)
        return 2
    setup_logging()
    try:
        recipe = load_recipe(argv[0], argv[1:])
    except RecipeError as err:
        print(err, file=sys.stderr)
        return 2
    return train(recipe)


if __name__ == "__main__":
    sys.exit(main())
