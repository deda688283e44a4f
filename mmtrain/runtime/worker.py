"""The worker entry started by the launcher through torchrun (mmtrain/runtime/launcher.py):

    python -m torch.distributed.run ... -m mmtrain.runtime.worker RUN_DIR/config.yaml

Light at import: logging is set up (third-party warnings hidden unless MMTRAIN_VERBOSE=1) before
the training code (megatron, torch) is imported, at dispatch (mmtrain/runtime/training.py).
The `__main__` guard matters: megatron's dist-checkpointing writer starts a `spawn`
multiprocessing manager, which re-imports the main module.
"""

from __future__ import annotations

import sys

from mmdata.errors import UserError
from mmtrain.config import load_recipe
from mmtrain.runtime.logs import setup_logging
from mmtrain.spec import resolve

#: what a worker runs, imported once logging is set up
TRAIN = "mmtrain.runtime.training:train"
#: the recipe's family, from the registry (which sits above the runtime: its families build on it)
GET_FAMILY = "mmtrain.registry:get_family"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m mmtrain.runtime.worker RESOLVED_RECIPE [KEY=VALUE ...]", file=sys.stderr)
        return 2
    setup_logging()
    try:  # the launcher checked the recipe and what it points at; a problem found here is still one line
        recipe = load_recipe(argv[0], argv[1:])
        return resolve(TRAIN)(recipe, resolve(GET_FAMILY)(recipe.family))
    except UserError as err:
        print(f"mmtrain worker: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
