"""Log set-up of every mmtrain process: INFO on the ranks that matter, third-party warnings and
progress bars hidden unless --verbose."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def setup_logging(rank: int | None = None, verbose: bool = True, verbose_third_party: bool | None = None) -> None:
    """INFO logs on the ranks that matter (rank 0, and the one holding the loss), warnings
    everywhere (MMTRAIN_LOG_ALL_RANKS=1: INFO everywhere). Third-party noise (megatron's and
    torch's warnings about optional packages, energon's "Filling reading buffer" bars) is
    silenced unless --verbose (MMTRAIN_VERBOSE=1 in the workers)."""
    if verbose_third_party is None:
        verbose_third_party = os.environ.get("MMTRAIN_VERBOSE") == "1"
    if not verbose_third_party:
        quiet_third_party()
    prefix = f"[rank {rank}] " if rank is not None else ""
    level = logging.INFO if (verbose or os.environ.get("MMTRAIN_LOG_ALL_RANKS")) else logging.WARNING
    root = logging.getLogger()
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(name)s %(levelname)s: %(message)s", "%H:%M:%S")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        root.addHandler(handler)
    # (type checker: the loop rebinds the name to every root handler)
    for handler in root.handlers:  # type: ignore[assignment]
        handler.setFormatter(fmt)
    root.setLevel(logging.WARNING)
    logging.getLogger("mmtrain").setLevel(level)


#: modules whose warnings are not the user's business by default (optional accelerators absent,
#: deprecations inside megatron, pin_memory without a GPU)
THIRD_PARTY_WARNINGS = r"(megatron|torch|transformers|apex|transformer_engine|tensorboard)(\.|$)"


def quiet_third_party() -> None:
    """Hide third-party warnings and progress bars (inherited by loader workers)."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm at import (energon's packing buffer bar)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY_WARNINGS)
