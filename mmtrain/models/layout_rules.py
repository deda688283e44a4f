"""Layout rules a recipe must meet, as arithmetic on sizes: the multiple a sequence length must be
for megatron's context-parallel split, and the TP the vision tower's own layout accepts. A leaf
(imports nothing of the project): config checks recipes with it, planning searches with it, the
model builders refuse with it."""

from __future__ import annotations

from typing import Optional


def sequence_split_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What `train.seq_length` must be a multiple of for megatron to split it over CP (2*cp
    chunks) and, with sequence parallelism, each CP share over TP."""
    if cp <= 1:
        return 1
    return 2 * cp * (tp if sequence_parallel and tp > 1 else 1)


def check_encoder_tp(encoder_tp: Optional[int], tp: int) -> Optional[str]:
    """Why `parallel.vision.tp` cannot run with the language model's `tp` (None: it can)."""
    if encoder_tp is None or encoder_tp in (1, tp):
        return None
    return (
        f"{encoder_tp} with parallel.tp={tp}: the vision tower's own layout is TP 1 (a whole tower per rank, "
        f"each encoding a share of the tiles) or parallel.tp ({tp}: sharded like the language model, the tiles "
        "split over the CP group); null (the default) inherits the language model's layout"
    )
