"""What a sequence length must divide into for megatron's context-parallel split. A leaf (imports
nothing of the project): config checks it, planning searches with it."""

from __future__ import annotations


def sequence_split_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What `train.seq_length` must be a multiple of for megatron to split it over CP (2*cp
    chunks) and, with sequence parallelism, each CP share over TP."""
    if cp <= 1:
        return 1
    return 2 * cp * (tp if sequence_parallel and tp > 1 else 1)
