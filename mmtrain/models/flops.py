"""Model FLOPs: per token for planning, and per step from a step's real packed layout (sum of
len^2 per sample), freeze set and media for the train loop's MFU. Arithmetic on `ModelShapes`.

Two counts of a step: the model FLOPs (`step_flops` with `samples`: the real samples only, the
MFU's numerator) and the FLOPs the devices execute (`step_flops` without `samples`, padding runs
and CP padding in, plus `recompute_flops`: the HFU's numerator).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from mmtrain.models.shapes import DecoderShape, ModelShapes, decoder_layer_params, encoder_layer_params


@dataclass(frozen=True)
class PartFlops:
    """Forward FLOPs of one part, by how their backward is counted (see `part_passes`)."""

    weights: float = 0.0  # matmuls with the part's weights, reading the part's own activations
    core: float = 0.0  # weightless matmuls: attention's Q K^T and P V
    inputs: float = 0.0  # matmuls with the part's weights reading the part's input (patch conv, ...)

    def __add__(self, o: "PartFlops") -> "PartFlops":
        return PartFlops(self.weights + o.weights, self.core + o.core, self.inputs + o.inputs)

    @property
    def total(self) -> float:
        return self.weights + self.core + self.inputs


@dataclass(frozen=True)
class Passes:
    """Forward-equivalents one training step spends on each kind of a part's matmuls."""

    weights: int
    core: int
    inputs: int

    def apply(self, f: PartFlops) -> float:
        return self.weights * f.weights + self.core * f.core + self.inputs * f.inputs


def part_passes(shapes: ModelShapes, trainable_parts: Iterable[str]) -> dict[str, Passes]:
    """How many times each part's forward FLOPs are spent in a training step, from which parts train.

    The rule, per matmul `Y = X W` of forward cost F: backward computes `dX = dY W^T` (F) when
    anything before it needs a gradient, and `dW = X^T dY` (F) when W trains. Attention's `Q K^T`
    and `P V` have no weights: whenever a gradient passes through them their backward computes
    both operands' gradients (2F). Parts run in data-flow order (encoder -> connectors -> decoder
    with its LM head, `ModelShapes.flow_order`); a gradient passes through a part when it trains
    or an earlier part does. So:

    - the part trains: weight matmuls 3x, attention 3x; a matmul reading the part's input (the
      patch conv on pixels, the projector's first linear on the tower's output) 3x only when an
      earlier part trains, else 2x (autograd computes no gradient for an input that needs none);
    - frozen, an earlier part trains (e.g. the LLM at LLaVA-OV stage 1, under the trained
      projector): weight matmuls 2x (forward + input gradient), attention 3x, input matmuls 2x;
    - frozen and no earlier part trains (e.g. the vision tower at stage 1): 1x, forward only.

    Not counted (they are not model FLOPs): recompute's extra forward, flash attention's
    recomputation of the scores in backward, norms, softmax and other elementwise work."""
    trains = set(trainable_parts)
    out: dict[str, Passes] = {}
    upstream = False  # an earlier part trains
    for part in shapes.flow_order:
        t = part in trains
        flow = t or upstream
        out[part] = Passes(weights=1 + flow + t, core=1 + 2 * flow, inputs=1 + upstream + t)
        upstream = upstream or t
    return out


def _host_list(cu_seqlens: Any) -> list[int]:
    return [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]


def executed_lengths(cu_seqlens: Any, pad_to: int = 1) -> list[int]:
    """Segment lengths of one `cu_seqlens` (a micro-batch's flattened stream or one row) as the
    device runs them: every non-empty segment (a packed sample or a padding run; THD attention
    runs over each) padded up to `pad_to` (context parallelism pads each to 2*cp*tp:
    models/context_parallel.py). Takes a host tensor or a list; never reads a device."""
    cu = _host_list(cu_seqlens)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    return _padded(lens, pad_to)


def _padded(lens: list[int], pad_to: int) -> list[int]:
    return [-(-n // pad_to) * pad_to for n in lens] if pad_to > 1 else lens


def sample_lengths(cu_seqlens: Any, samples_per_row: Sequence[int]) -> list[int]:
    """The real samples' segment lengths of one micro-batch's `cu_seqlens` over its flattened
    rows x seq_length stream: a row holds its samples back to back, then a padding run, so the
    first `samples_per_row[r]` (= `len(sample_ids[r])`) segments starting in row r are samples,
    as `runtime/loss.py` `per_sample_loss_sums` reads them. The stream covers every row, so a
    row is `cu[-1] / rows` positions long."""
    cu = _host_list(cu_seqlens)
    rows = len(samples_per_row)
    if rows == 0 or cu[-1] % rows:
        raise ValueError(f"cu_seqlens ending at {cu[-1]} is not {rows} rows of equal length")
    row_length = cu[-1] // rows
    by_row: list[list[int]] = [[] for _ in range(rows)]
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            by_row[a // row_length].append(b - a)
    return [n for row, count in zip(by_row, samples_per_row) for n in row[:count]]


def _decoder_forward(d: DecoderShape, tokens: int, sum_sq: int) -> PartFlops:
    """Layers (2 FLOPs per weight per token; causal attention 2*q*len^2 per sample: half of the
    4*q*len^2 of Q K^T + P V over a full len x len matrix) + the LM head on every position."""
    q = d.heads * d.kv_channels
    return PartFlops(
        weights=tokens * (d.layers * 2 * decoder_layer_params(d) + 2 * d.hidden * d.padded_vocab(1)),
        core=d.layers * 2 * q * sum_sq,
    )


def _media_forward(shapes: ModelShapes, tiles: int) -> dict[str, PartFlops]:
    """Encoder + connectors on `tiles` tiles/frames: each tile is `patches` tokens through the
    patch conv, every layer (full attention over the tile: 4*h*patches^2) and the connectors."""
    v = shapes.encoder
    if v is None or tiles <= 0:
        return {}
    n = tiles * v.patches
    out = {
        shapes.encoder_part: PartFlops(
            weights=n * v.layers * 2 * encoder_layer_params(v),
            core=tiles * v.layers * 4 * v.hidden * v.patches**2,
            inputs=n * 2 * v.channels * v.patch_size**2 * v.hidden,
        )
    }
    for c in shapes.connectors:
        f = PartFlops(
            weights=2.0 * n * (c.matmul_params - c.input_matmul_params), inputs=2.0 * n * c.input_matmul_params
        )
        out[c.part] = out.get(c.part, PartFlops()) + f
    return out


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one step's micro-batches (one model replica's share of the global batch)."""

    by_part: dict[str, float]  # training FLOPs per part (passes applied)
    forward: float  # forward FLOPs of all parts
    tokens: int  # decoder positions counted (CP padding included when `pad_to` > 1)
    sum_len_sq: int  # sum of len^2 over the counted segments
    tiles: int  # tiles/frames through the encoder

    @property
    def total(self) -> float:
        return sum(self.by_part.values())


def step_flops(
    shapes: ModelShapes,
    cu_seqlens: Iterable[Any],
    tiles: int,
    trainable_parts: Iterable[str],
    *,
    pad_to: int = 1,
    samples: Optional[Iterable[Optional[Sequence[int]]]] = None,
) -> StepFlops:
    """Training FLOPs of one step from its real packed layout: `cu_seqlens` holds one host
    `cu_seqlens` per micro-batch (or per row: segments never cross rows), `tiles` the tiles/frames
    the encoder runs on, `trainable_parts` the parts not frozen, `pad_to` the CP padding multiple
    (`models.context_parallel.padding_multiple(cp, tp)`; 1 without CP). Decoder matmuls and the LM
    head scale with the counted positions, causal attention with sum(len_i^2) of the segments
    (THD attention runs per packed sample), the encoder with `tiles`; each part's backward
    follows `part_passes`.

    `samples`, one entry per `cu_seqlens`, the real samples of each of its rows
    (`[len(ids) for ids in batch.sample_ids]`): only those segments count (`sample_lengths`), so
    a row's padding run is not charged as model FLOPs (the MFU). None (or a None entry): every
    segment counts, padding runs included (what the device executes: the HFU's count). The train
    loop's MFU (runtime/throughput.py) and benchmarks call it."""
    tokens = sum_sq = 0
    per_batch = samples if samples is not None else itertools.repeat(None)
    for cu, rows in zip(cu_seqlens, per_batch):
        lens = executed_lengths(cu, pad_to) if rows is None else _padded(sample_lengths(cu, rows), pad_to)
        tokens += sum(lens)
        sum_sq += sum(n * n for n in lens)
    fwd = {shapes.decoder_part: _decoder_forward(shapes.decoder, tokens, sum_sq)}
    for part, f in _media_forward(shapes, tiles).items():
        fwd[part] = fwd.get(part, PartFlops()) + f
    passes = part_passes(shapes, trainable_parts)
    by_part = {part: passes[part].apply(f) for part, f in fwd.items()}
    return StepFlops(by_part, sum(f.total for f in fwd.values()), tokens, sum_sq, int(tiles))


def recompute_flops(
    shapes: ModelShapes, executed: StepFlops, trainable_parts: Iterable[str], recompute: str, recomputed_layers: int = 0
) -> float:
    """The extra forward activation recompute runs in a step whose executed count is `executed`
    (`step_flops` without `samples`): `full` reruns the forward of the `recomputed_layers`
    checkpointed decoder layers (their weight matmuls and attention; megatron's uniform method
    checkpoints every layer, block the first N of each model chunk), `selective` reruns every
    decoder layer's core attention. Nothing when no gradient passes through the decoder (no
    backward, nothing recomputed). Only the decoder is checkpointed (the vision tower is not)."""
    if recompute not in ("full", "selective") or part_passes(shapes, trainable_parts)[shapes.decoder_part].core == 1:
        return 0.0
    d = shapes.decoder
    core = _decoder_forward(d, 0, executed.sum_len_sq).core / d.layers  # one layer's attention
    if recompute == "selective":
        return core * d.layers
    weights = executed.tokens * 2 * decoder_layer_params(d)  # one layer's weight matmuls
    return recomputed_layers * (weights + core)


def recomputed_layer_count(chunk_layers: Iterable[int], recompute_num_layers: int) -> int:
    """Decoder layers full recompute checkpoints over a model's chunks (`PipelineSplit.counts`,
    flattened): all of each chunk (`recompute_num_layers` 0, the uniform method), else the first
    N of each (block)."""
    return sum(min(recompute_num_layers, n) if recompute_num_layers else n for n in chunk_layers)


def forward_flops_per_token(shapes: ModelShapes, seq_length: int) -> tuple[float, float, float]:
    """(decoder matmuls + causal attention, LM head, encoder + connectors per media token) for one
    sample filling a `seq_length` row: the dry run's and auto-tune's per-token view (an upper bound
    on attention for packed rows; `step_flops` counts each batch's real layout)."""
    d = shapes.decoder
    decoder = d.layers * (2 * decoder_layer_params(d) + 2 * d.heads * d.kv_channels * seq_length)
    head = 2 * d.hidden * d.padded_vocab(1)
    media = 0.0
    if shapes.encoder is not None:
        media = sum(f.total for f in _media_forward(shapes, 1).values()) / shapes.encoder.patches
    return decoder, head, media


def tile_token_cost(shapes: ModelShapes) -> float:
    """What one media tile costs in decoder tokens: forward FLOPs of a tile through the encoder and
    the connectors over those of one token through the decoder's matmuls and LM head (attention
    left out: it depends on the packing). Vision-aware balancing weighs a row's tiles with it
    (mmdata.packing.balance); 0 for a family without an encoder."""
    if shapes.encoder is None:
        return 0.0
    tile = sum(f.total for f in _media_forward(shapes, 1).values())
    return tile / _decoder_forward(shapes.decoder, 1, 0).total


def training_flops_per_token(shapes: ModelShapes, seq_length: int) -> float:
    """Decoder + LM-head training FLOPs per token when every part trains and one sample fills each
    `seq_length` row (3 x the forward). An estimate for planning only: the train loop's MFU comes
    from `step_flops` on each step's packed layout, freeze set and media."""
    decoder, head, _ = forward_flops_per_token(shapes, seq_length)
    return 3.0 * (decoder + head)
