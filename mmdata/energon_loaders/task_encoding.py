"""What every family's task encoder shares on energon's side: counted skips, packing through
energon's hooks, the batch hook and the `PackedBatch` fields of packed rows (the token sequence
of one sample and the over-length policy are in `sequence.py`).

A family's encoder subclasses `PackingTaskEncoder`, turns raw samples into encoded samples that
carry `input_ids` and shifted `labels` (energon's `encode_sample` or `preencode_sample` /
`postencode_sample`), and implements `collate(rows, stats)`; selection of the samples that share
a row, the packed sample and the batch hook are done here. The shared batch fields come from
`packed_batch_fields`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Sequence

from megatron.energon import Sample, SkipSample, TaskEncoder, edataclass, stateless
from megatron.energon.errors import FatalSampleError

from mmdata.energon_loaders.labels import IGNORE_INDEX
from mmdata.energon_loaders.packing import pack_rows, shift_labels
from mmdata.energon_loaders.row_mix import pack_buffer
from mmdata.energon_loaders.sequence import TokenSequence, TruncationResult, apply_length_policy
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.shard_format import SAMPLE_KEY_SEP

log = logging.getLogger(__name__)


@edataclass
class PackedSamples(Sample):
    """The encoded samples energon's packing put into one row."""

    samples: list


def skip_key(reason: str) -> str:
    """The stats counter of a skip reason (`LoaderStats.skipped` strips the prefix)."""
    return f"skipped/{reason}"


class PackingTaskEncoder(TaskEncoder):
    """Counted skips, packing hooks and the batch hook of a family's task encoder.

    Encoded samples must have `input_ids` (their length is what packing fills rows with); the
    family's encoder config gives `seq_length`, and the subclass implements `collate`. Skips and
    other counters travel to the main process in each batch's `stats` (per worker, since its
    previous batch)."""

    # Media stay as stored (bytes / arrays): decoding happens in the encoder, where a failure
    # becomes a counted skip instead of a dead worker.
    decoder = None
    #: the stored sample type the family reads (named by the folder's `.nv-meta/mmdata.yaml`)
    sample_type: type = Sample

    def __init__(self, tokenizer_path: str, config: Any) -> None:
        """`config`: the family's encoder config (a dataclass with at least `seq_length`)."""
        super().__init__()
        self.config = config
        self.seq_length = config.seq_length
        self.tokenizer_path = str(tokenizer_path)
        self._stats: Counter = Counter()
        self._text: Any = None
        # Load once here (main process): a bad tokenizer fails early with a clear message, and
        # forked workers inherit it instead of each re-importing transformers and re-loading.
        _ = self.text

    def build_text(self, tokenizer: Any) -> Any:
        """The family's text side (chat template, task prompts) over the loaded HF tokenizer."""
        raise NotImplementedError

    @property
    def text(self) -> Any:
        """`build_text` of the local tokenizer folder (loaded lazily, once per process)."""
        if self._text is None:
            self._text = self.build_text(load_local_tokenizer(self.tokenizer_path))
        return self._text

    def _require_sample_type(self, sample: Any) -> None:
        """A folder read through its plain `dataset.yaml` hands over energon's standard
        `InterleavedSample` (for readers without mmdata): name that instead of an attribute error
        deep in the encoder. Fatal, not a skip: every other sample of the folder is the same."""
        if not isinstance(sample, self.sample_type):
            raise FatalSampleError(
                f"{type(self).__name__} reads {self.sample_type.__name__} samples, got {type(sample).__name__} "
                f"(sample {getattr(sample, '__key__', '?')!r}): the dataset was opened with its plain "
                "`.nv-meta/dataset.yaml`; pass dataset_config='mmdata.yaml' to energon (or add "
                "`dataset_config: mmdata.yaml` to the metadataset entry)"
            )

    def _skip(self, reason: str, sample_id: str, detail: str = "") -> SkipSample:
        """Count and log a bad sample; energon drops a sample raising SkipSample (no tolerance
        counter, so bad data never stops training)."""
        self._stats[skip_key(reason)] += 1
        message = f"sample {sample_id!r} skipped: {reason}{': ' + detail if detail else ''}"
        log.warning(message)
        return SkipSample(message)

    def _count(self, key: str, n: int = 1) -> None:
        self._stats[key] += n

    def _fit_length(self, tokens: TokenSequence, sample_id: str) -> TruncationResult:
        """The sample's tokens under the over-length policy (`apply_length_policy`), truncations
        counted; a sample with no loss token, or too long to cut, is a counted skip."""
        if not (tokens.labels != IGNORE_INDEX).any():
            raise self._skip("no_assistant_tokens", sample_id)
        result = apply_length_policy(tokens, self.seq_length)
        if result.tokens is None:
            raise self._skip(result.outcome, sample_id, f"{len(tokens)} tokens > seq_length {self.seq_length}")
        if result.outcome == "truncated":
            self._count("truncated")
        return result

    @staticmethod
    def _encoded(
        sample_cls: type[Sample], sample: Sample, sample_id: str, result: TruncationResult, **fields: Any
    ) -> Any:
        """The family's `sample_cls` of a sample `_fit_length` fitted: its tokens, the labels
        shifted for next-token loss, whether it was truncated, and the family's own `fields`."""
        return sample_cls.derive_from(
            sample,
            id=sample_id,
            input_ids=result.tokens.input_ids,
            labels=shift_labels(result.tokens.labels),
            truncated=result.outcome == "truncated",
            **fields,
        )

    def _take_stats(self) -> dict[str, int]:
        stats = dict(self._stats)
        self._stats.clear()
        return stats

    # -- energon packing / batching hooks ---------------------------------------------------

    def vision_tiles(self, sample: Any) -> int:
        """Tiles and video frames the vision tower will encode for a pre-encoded sample (what
        packing evens out between rows); 0 for a family without a vision tower."""
        return 0

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        bins = pack_buffer(
            [len(s.input_ids) for s in samples], [self.vision_tiles(s) for s in samples], self.seq_length
        )
        return [[samples[i] for i in b] for b in bins]

    @stateless
    def pack_selected_samples(self, samples: list[Any]) -> PackedSamples:
        if not samples:  # every sample of this pack failed to decode (already counted)
            raise SkipSample("empty pack")
        return PackedSamples(
            __key__=",".join(s.__key__ for s in samples),
            __restore_key__=(),
            __subflavors__=None,
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            samples=list(samples),
        )

    @stateless
    def batch(self, samples: list[Any]) -> Any:
        return self.batch_rows([s.samples if isinstance(s, PackedSamples) else [s] for s in samples])

    def batch_rows(self, rows: list[list[Any]]) -> Any:
        """Rows of encoded samples -> the family's batch with this worker's counters. An empty row
        is a row of padding (no sample id, no loss token, so it adds nothing to the per-token
        loss): the global order keeps a row whose samples were all skipped, so a rank's step still
        has its micro-batches and rows."""
        return self.collate(rows, self._take_stats())

    def collate(self, rows: list[list[Any]], stats: dict[str, int]) -> Any:
        """Rows of encoded samples -> the family's batch (a PackedBatch subclass)."""
        raise NotImplementedError


def sample_key(sample: Any) -> str:
    """`DATASET#SHARD_KEY`: unique across shards, subsets and blended datasets (a record `id`
    repeats across sources, a shard key across datasets), and found again in O(1) with
    `mmdata preview DATASET --key SHARD_KEY` (a shard key is the sample's global index)."""
    sources = getattr(sample, "__sources__", None) or ()
    return f"{sources[0].dataset_path}{SAMPLE_KEY_SEP}{sample.__key__}" if sources else str(sample.__key__)


def packed_batch_fields(
    rows: Sequence[Sequence[Any]], seq_length: int, pad_token_id: int, stats: dict[str, int] | None = None
) -> dict[str, Any]:
    """The `PackedBatch` fields of rows of encoded samples (each with `id`, `input_ids` and
    shifted `labels`): packed tensors, attention metadata, ids and counters."""
    packed = pack_rows([[(s.input_ids, s.labels) for s in row] for row in rows], seq_length, pad_token_id)
    return dict(
        input_ids=packed.input_ids,
        labels=packed.labels,
        position_ids=packed.position_ids,
        cu_seqlens=packed.cu_seqlens,
        max_seqlen=packed.max_seqlen,
        sample_ids=[[s.id for s in row] for row in rows],
        num_loss_tokens=int((packed.labels != IGNORE_INDEX).sum()),
        sample_keys=[[sample_key(s) for s in row] for row in rows],
        num_real_tokens=packed.num_real_tokens,
        stats=dict(stats or {}),
    )
