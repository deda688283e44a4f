"""Worker entry point started by `mmtrain FAMILY RECIPE` through torchrun:

    python -m torch.distributed.run ... -m mmtrain.runtime.worker RUN_DIR/config.yaml

The `__main__` guard matters: megatron's dist-checkpointing writer starts a `spawn`
multiprocessing manager, which re-imports the main module.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from mmdata.errors import UserError
    from mmtrain.config import load_recipe
    from mmtrain.runtime.launch import setup_logging, train

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m mmtrain.runtime.worker RESOLVED_RECIPE [KEY=VALUE ...]", file=sys.stderr)
        return 2
    setup_logging()
    try:  # the launcher checked the recipe and what it points at; a problem found here is still one line
        return train(load_recipe(argv[0], argv[1:]))
    except UserError as err:
        print(f"mmtrain worker: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
