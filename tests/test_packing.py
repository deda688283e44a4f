"""Packing: bin selection, attention metadata, efficiency on the synthetic mix."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmdata.energon_loaders.packing import (
    pack_rows,
    packing_efficiency,
    shift_labels,
)
from mmdata.packing.knapsack import largest_first_knapsack

pytestmark = pytest.mark.unit


def test_bins_place_every_index_once_within_capacity():
    select = largest_first_knapsack
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 900, size=int(rng.integers(1, 80))).tolist()
        bins = select(lengths, 1000)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 1000 for b in bins)
        assert all(b == sorted(b) for b in bins)
    assert select([5, 5, 5], 10) == select([5, 5, 5], 10)  # deterministic


def test_knapsack_fills_rows_exactly_when_possible():
    bins = largest_first_knapsack([6, 5, 4, 3, 2], 10)
    assert sorted(sorted([6, 5, 4, 3, 2][i] for i in b) for b in bins) == [[2, 3, 5], [4, 6]]


def test_pack_rows_segments_never_cross_samples():
    rng = np.random.default_rng(1)
    rows = []
    for lens in ([3, 5, 2], [10], [4, 4]):
        row = []
        for n in lens:
            ids = rng.integers(0, 100, size=n)
            row.append((ids, shift_labels(ids.copy())))
        rows.append(row)
    out = pack_rows(rows, 12, pad_token_id=0)
    assert out.input_ids.shape == (3, 12)
    # segments: row0 3,5,2,pad2 | row1 10,pad2 | row2 4,4,pad4
    assert out.cu_seqlens.tolist() == [0, 3, 8, 10, 12, 22, 24, 28, 32, 36]
    assert out.cu_seqlens.dtype == torch.int32
    assert out.max_seqlen == 10
    flat_pos = out.position_ids.flatten()
    flat_lab = out.labels.flatten()
    for a, b in zip(out.cu_seqlens[:-1].tolist(), out.cu_seqlens[1:].tolist()):
        assert flat_pos[a:b].tolist() == list(range(b - a))  # restart per segment
        assert flat_lab[b - 1] == IGNORE_INDEX  # no target crosses a boundary
    assert out.num_real_tokens == 10 + 10 + 8
    assert (out.labels[0, 10:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError):
        pack_rows([[(np.zeros(13, dtype=np.int64), np.zeros(13, dtype=np.int64))]], 12, 0)


@pytest.fixture(scope="module")
def mix_lengths() -> list[int]:
    return _synthetic_mix_lengths()


def _synthetic_mix_lengths(num_samples: int = 600) -> list[int]:
    """Token lengths of the synthetic Infinity-MM mix as the loader would count them."""
    from PIL import Image
    from transformers import AutoTokenizer

    from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer
    from mmdata.energon_loaders.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmdata.preprocess.synth import generate_records

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        chat = ChatTokenizer(AutoTokenizer.from_pretrained(build_tiny_qwen2_tokenizer(d)))
    lengths = []
    for rec in generate_records(num_samples, seed=0, synthetic=True):
        sizes = []
        for im in rec.images:
            with Image.open(io.BytesIO(im.data)) as pil:
                sizes.append((pil.height, pil.width))
        counts = (
            [anyres.num_image_tokens(*sizes[0])] if len(sizes) == 1 else [anyres.num_base_only_tokens()] * len(sizes)
        )
        conv = [dict(t) for t in rec.record["conversations"]]
        text = "".join(t["value"] for t in conv)
        missing = len(sizes) - text.count("<image>")
        if missing > 0:  # preprocess inserts the placeholder when the source lacks it
            conv[0]["value"] = "<image>\n" * missing + conv[0]["value"]
        lengths.append(len(chat.tokenize(conv, counts)))
    return lengths


@pytest.mark.parametrize("seq_length,buffer,minimum", [(8192, 256, 0.95), (16384, 256, 0.95), (4096, 256, 0.8)])
def test_packing_efficiency_on_synthetic_mix(seq_length, buffer, minimum, mix_lengths):
    lengths = mix_lengths
    bins: list[list[int]] = []
    for start in range(0, len(lengths), buffer):  # energon hands the pre-packer one buffer at a time
        chunk = lengths[start : start + buffer]
        bins += [[chunk[i] for i in b] for b in largest_first_knapsack(chunk, seq_length)]
    assert sorted(x for b in bins for x in b) == sorted(lengths)
    eff = packing_efficiency(bins, seq_length)
    print(f"packing efficiency at {seq_length}: {eff:.4f} over {len(bins)} rows")
    assert eff >= minimum


def test_overfull_row_is_fatal_to_the_loader_not_a_skipped_sample():
    """More tokens than seq_length in one row is a broken invariant: energon's handler must not
    skip it (it would skip batch after batch and the run would exit 0)."""
    from megatron.energon.errors import SYSTEM_EXCEPTIONS, FatalSampleError

    sample = (np.arange(6), np.arange(6))
    with pytest.raises(FatalSampleError, match="exceed seq_length 8"):
        pack_rows([[sample, sample]], seq_length=8, pad_token_id=0)
    assert FatalSampleError in SYSTEM_EXCEPTIONS  # what energon re-raises instead of handling
