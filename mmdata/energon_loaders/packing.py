"""Sequence packing: packed-row metadata (model-agnostic, reused by Emu3).

Which buffered samples share a row is `mmdata.packing.knapsack.largest_first_knapsack`
(energon's `select_samples_to_pack` hook, whose rows `row_mix.pack_buffer` then evens in vision
tiles); `pack_rows` concatenates per-sample token arrays into fixed [B, S] rows and builds the
attention metadata: position ids restarting per sample and `cu_seqlens` over the flattened B*S
stream with one segment per sample and one per padding run, so varlen attention never crosses a
sample boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from megatron.energon.errors import FatalSampleError

from mmdata.energon_loaders.sequence import IGNORE_INDEX

#: samples the loader buffers per packing decision (energon's `packing_buffer_size`)
DEFAULT_PACKING_BUFFER = 256


def packing_efficiency(bin_lengths: Sequence[Sequence[int]], capacity: int) -> float:
    """Real tokens / slots over the given bins."""
    if not bin_lengths:
        return 0.0
    return float(sum(sum(b) for b in bin_lengths)) / float(capacity * len(bin_lengths))


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [B, S]
    cu_seqlens: torch.Tensor  # [segments + 1] int32
    max_seqlen: int
    num_real_tokens: int


def pack_rows(
    rows: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], seq_length: int, pad_token_id: int
) -> PackedRows:
    """rows[b] = [(input_ids, shifted_labels), ...] per sample -> padded [B, S] tensors."""
    batch = len(rows)
    input_ids = np.full((batch, seq_length), pad_token_id, dtype=np.int64)
    labels = np.full((batch, seq_length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((batch, seq_length), dtype=np.int64)
    seg_lengths: list[int] = []
    real = 0
    for b, samples in enumerate(rows):
        pos = 0
        for ids, lab in samples:
            n = int(ids.shape[0])
            if pos + n > seq_length:  # a broken invariant (e.g. a loader state of other data), not a bad
                # sample: energon's error handler would skip such batches until 100 in a row failed
                raise FatalSampleError(f"row {b}: packed samples exceed seq_length {seq_length}")
            input_ids[b, pos : pos + n] = ids
            labels[b, pos : pos + n] = lab
            position_ids[b, pos : pos + n] = np.arange(n)
            seg_lengths.append(n)
            pos += n
        real += pos
        if pos < seq_length:
            position_ids[b, pos:] = np.arange(seq_length - pos)
            seg_lengths.append(seq_length - pos)
    cu = np.zeros(len(seg_lengths) + 1, dtype=np.int32)
    np.cumsum(seg_lengths, out=cu[1:])
    return PackedRows(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=int(max(seg_lengths)) if seg_lengths else 0,
        num_real_tokens=real,
    )


def shift_labels(targets: np.ndarray) -> np.ndarray:
    """Unshifted per-token targets -> Megatron's shifted labels for ONE sample (last = ignore)."""
    out = np.full_like(targets, IGNORE_INDEX)
    out[:-1] = targets[1:]
    return out
