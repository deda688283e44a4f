"""Analytical cost model: per-rank memory and step time from a recipe, without building the model
(`dry_run` prints it, `auto_tune` searches layouts with it).
Design notes: docs/training.md, "The cost model: memory and step time from a recipe"."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mmdata.units import format_bytes
from mmtrain.models.flops import forward_flops_per_token, part_passes, step_flops
from mmtrain.models.pipeline_split import PipelineSplit, balanced_layers, split_layers
from mmtrain.models.shapes import (
    DecoderShape,
    EncoderShape,
    ModelShapes,
    decoder_layer_params,
    encoder_params,
    param_counts,
)

GB = 1024**3  # a GiB: `auto_tune.device_memory_gb` and every memory figure are in GiB


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """What the memory/time model needs from a recipe; auto_tune varies tp/pp/vpp/cp/mbs/recompute."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    recompute: str
    sequence_parallel: bool
    distributed_optimizer: bool
    precision: str
    cp: int = 1
    lm_loss: str = "auto"  # parallel.lm_loss; anything but "plain" is estimated as the chunked loss
    lm_loss_block_mb: int = 256
    recompute_num_layers: int = 0  # with full recompute: 0 = every layer, N = the first N of each stage
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    pp_layers: tuple[int, ...] = ()  # decoder layers per stage or virtual stage; () = megatron's even split
    vision_tp: int | None = None  # parallel.vision.tp: the encoder's own TP; None = the decoder's layout

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tokens_per_rank(self) -> int:
        """Token positions of one micro-batch that one rank runs (1/cp of each sequence)."""
        return self.micro_batch_size * self.seq_length // self.cp

    @classmethod
    def from_recipe(cls, recipe: Any) -> "Layout":
        p, t = recipe.parallel, recipe.train
        return cls(
            p.tp,
            p.pp,
            p.dp,
            t.micro_batch_size,
            t.global_batch_size,
            t.seq_length,
            p.recompute,
            p.sequence_parallel and p.tp > 1,
            p.distributed_optimizer,
            p.precision,
            p.cp,
            p.lm_loss,
            p.lm_loss_block_mb,
            recompute_num_layers=p.recompute_num_layers if p.recompute == "full" else 0,
            vpp=p.vpp,
            pp_layers=tuple(p.pp_layers),
            vision_tp=p.vision.tp,
        )

    @property
    def encoder_tp(self) -> int:
        """TP of the encoder's weights."""
        return self.tp if self.vision_tp is None else self.vision_tp

    @property
    def encoder_shares(self) -> int:
        """Ranks that split one micro-batch's media between them: the CP ranks (each its chunk's)
        when inherited, every (tp / vision_tp) x cp rank with the encoder's own layout."""
        return self.cp if self.vision_tp is None else self.tp // self.vision_tp * self.cp

    def split(self, num_layers: int) -> PipelineSplit:
        """The decoder's layers per stage and virtual stage as megatron builds them
        (models/pipeline_split.py); PipelineSplitError where it would not."""
        return split_layers(num_layers, self.pp, self.vpp, self.pp_layers)

    def estimated_split(self, num_layers: int) -> PipelineSplit:
        """`split`, except that a plain pp not dividing the layers (megatron refuses it when it
        builds the model) spreads them as evenly as they go, so a dry run still estimates it."""
        if not self.pp_layers and self.vpp == 1 and num_layers % self.pp:
            return split_layers(num_layers, self.pp, pp_layers=balanced_layers(num_layers, self.pp))
        return self.split(num_layers)

    def recomputed_layers(self, chunk_layers: int) -> int:
        """Decoder layers of a model chunk (a stage, or a virtual stage) whose activations are
        recomputed (full recompute; megatron's block method counts N per chunk)."""
        if self.recompute != "full":
            return 0
        return min(self.recompute_num_layers, chunk_layers) if self.recompute_num_layers else chunk_layers

    def with_(self, **kw: Any) -> "Layout":
        return replace(self, **kw)


# ----------------------------------------------------------------------------- memory


@dataclass
class MemoryEstimate:
    """Bytes on one pipeline stage's ranks (`estimate_memory`: the stage with the largest total)."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    encoder_activations: float
    params_on_rank: int
    decoder_layers: int = 0  # decoder layers this stage holds (over its virtual stages)
    #: the fp32 buffer megatron flattens a replicated encoder's gradients into for their TP average
    #: (`tp_grad_average_bytes`): it lives after the backward, when the activations are freed
    grad_average_buffer: float = 0.0

    @property
    def total(self) -> float:
        transient = max(self.activations + self.logits + self.encoder_activations, self.grad_average_buffer)
        return self.weights + self.grads + self.optimizer + transient


def _act_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of each forward pass of a pipeline rank, in the order megatron's
    interleaved schedule runs them (`schedules.get_schedule_table`): groups of `group` micro-batches
    (its `microbatch_group_size_per_vp_stage`, by default pp) through every chunk in turn."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(first, last)]
    return table


def forwards_in_flight(L: Layout, stage: int) -> list[int]:
    """Per model chunk of pipeline rank `stage`, the forward passes whose activations it holds at
    its peak: the warm-up forwards plus the first steady-state one, before a backward frees any.
    1F1B (one chunk): min(pp - stage, m) micro-batches. Interleaved: megatron's warm-up
    ((pp - stage - 1) * 2 + (vpp - 1) * pp forwards, `get_pp_rank_microbatches`) read off its
    schedule table, so each chunk is charged for its own passes (megatron's
    `interleaved_schedule_memory_penalty`, 1 + (pp-1)/(pp*vpp) for the first stage, when chunks
    are even)."""
    m = L.grad_accum
    if L.vpp == 1:
        return [min(L.pp - stage, m)]
    warmup = (L.pp - stage - 1) * 2 + (L.vpp - 1) * L.pp
    passes = schedule_table(m, L.vpp, L.pp)[: warmup + 1]
    return [sum(1 for _, chunk in passes if chunk == c) for c in range(L.vpp)]


def decoder_layer_activation_elems(d: DecoderShape, tp: int, sp: bool) -> float:
    """Elements kept per token by one decoder layer of the local spec for backward (no
    recompute), counted from what autograd saves (tests/test_train_runtime.py measures it)."""
    q, kv = d.heads * d.kv_channels, d.kv_groups * d.kv_channels
    replicated = 4 * d.hidden  # two norm inputs + two norm outputs (split only with SP)
    rope = 4 * d.kv_channels  # cos and sin tables of the q and k rotations, per token
    # attention: q, k, v and the output kept by the attention kernel, the output the projection
    # keeps; SwiGLU (unfused): fc1 output (gate + up), silu(gate), the up half, their product
    sharded = (q + 2 * kv) + 2 * q + 5 * d.ffn
    return replicated / (tp if sp else 1) + rope + sharded / tp


def encoder_layer_activation_elems(v: EncoderShape, tp: int) -> float:
    return 4 * v.hidden + (3 * v.hidden + v.hidden + 2 * v.ffn) / tp


def estimate_memory(
    shapes: ModelShapes, freeze: list[str], layout: Layout, media_token_fraction: float = 1.0
) -> MemoryEstimate:
    """The busiest pipeline stage's memory (`estimate_stage_memory`)."""
    return max(estimate_stage_memory(shapes, freeze, layout, media_token_fraction), key=lambda m: m.total)


def estimate_stage_memory(
    shapes: ModelShapes, freeze: list[str], layout: Layout, media_token_fraction: float = 1.0
) -> list[MemoryEstimate]:
    """Per pipeline stage, the memory of one of its ranks: the decoder layers of its split
    (`parallel.pp_layers`), the encoder, connectors and embedding on the first stage, the head and
    loss on the last, activations of the forwards each of its chunks keeps in flight."""
    d, v, L = shapes.decoder, shapes.encoder, layout
    counts = param_counts(shapes, freeze, L.tp)
    frozen = {k: counts.trainable[k] == 0 for k in counts.parts}
    dec_frozen = frozen[shapes.decoder_part]
    ab = _act_bytes(L.precision)
    tokens = L.tokens_per_rank
    w_bytes, g_bytes, o_bytes = (2, 4, 12) if L.precision == "bf16" else (4, 4, 8)
    o_share = 1 / (L.dp * L.cp) if L.distributed_optimizer else 1.0  # sharded over the DP x CP group
    split = L.estimated_split(d.layers)

    out = []
    for stage in range(L.pp):
        chunk_layers = split.counts[stage]
        n_layers = sum(chunk_layers)
        flights = forwards_in_flight(L, stage)
        first, last = stage == 0, stage == L.pp - 1
        parts: list[tuple[float, bool]] = [(n_layers * decoder_layer_params(d) / L.tp, dec_frozen)]
        if first:
            parts.append((counts.decoder_embedding / L.tp, dec_frozen))
            if v is not None:
                parts.append((encoder_params(v) / L.encoder_tp, frozen[shapes.encoder_part]))
            parts += [(c.params / L.tp, frozen[c.part]) for c in shapes.connectors]
        if last:
            out_layer = counts.decoder_embedding / L.tp
            if not d.tied or (L.pp > 1):  # untied head, or the tied copy megatron keeps on the last stage
                parts.append((out_layer, dec_frozen))
            parts.append((d.hidden, dec_frozen))
        n_params = sum(n for n, _ in parts)
        n_train = sum(n for n, fz in parts if not fz)
        weights = n_params * w_bytes
        grads = n_train * g_bytes
        optimizer = n_train * o_bytes * o_share

        # decoder activations; a frozen decoder still back-propagates to the parts feeding it
        needs_backward = not all(frozen.values())
        per_layer = decoder_layer_activation_elems(d, L.tp, L.sequence_parallel) * tokens * ab
        layer_input = d.hidden / (L.tp if L.sequence_parallel else 1) * tokens * ab
        # + one layer's working set: the forward's live tensors, or a backward step's gradients
        acts = per_layer
        if needs_backward:
            for n, in_flight in zip(chunk_layers, flights):
                n_rc = L.recomputed_layers(n)  # full recompute keeps one input per recomputed layer
                acts += (n_rc * layer_input + (n - n_rc) * per_layer) * in_flight
        logits = lm_loss_bytes(d, L, tokens) if last else 0.0
        enc = 0.0
        if first and v is not None:  # on the first chunk
            batch_media = L.micro_batch_size * L.seq_length * media_token_fraction  # encoder tokens
            elayer = encoder_layer_activation_elems(v, L.encoder_tp) * batch_media / L.encoder_shares * ab
            trains_encoder = not frozen[shapes.encoder_part]
            enc = (v.layers * elayer * flights[0]) if trains_encoder else elayer
            if L.vision_tp is not None:  # + every share's output, gathered (kept for the projector)
                enc += batch_media * v.hidden * ab * (flights[0] if trains_encoder else 1)
        buffer = (
            tp_grad_average_bytes(L, counts.trainable.get(shapes.encoder_part, 0)) if first and v is not None else 0.0
        )
        out.append(MemoryEstimate(stage, weights, grads, optimizer, acts, logits, enc, int(n_params), n_layers, buffer))
    return out


def tp_grad_average_bytes(L: Layout, encoder_trainable: int) -> float:
    """The fp32 gradients a whole (`vision_tp` 1) trained encoder averages over TP after the step's
    DP reduce: megatron's `finalize_model_grads` tags them `average_gradients_across_tp_domain`,
    flattens every one of them into one new buffer (`_flatten_dense_tensors`), all-reduces it
    (AVG, off the overlap) and copies it back. 0 when nothing is averaged."""
    if L.vision_tp != 1 or L.tp <= 1 or encoder_trainable <= 0:
        return 0.0
    return encoder_trainable * 4.0


def lm_loss_bytes(d: DecoderShape, L: Layout, tokens: int) -> float:
    """Transient memory of the LM head + loss on the last stage for `tokens` positions."""
    local_vocab = d.padded_vocab(L.tp) // L.tp
    ab = _act_bytes(L.precision)
    upcast = 4 if ab != 4 else 0  # low-precision logits get an fp32 copy for the softmax
    if L.lm_loss == "plain":
        return tokens * local_vocab * (4 + upcast)  # fp32 logits/softmax (its gradient reuses it)
    rows = max(128, (L.lm_loss_block_mb * 2**20) // max(1, tokens * 8) // 128 * 128)  # lm_loss.vocab_block_size
    block = tokens * min(rows, local_vocab) * (4 + (upcast and ab + ab))  # fp32 block (+ matmul out, grad)
    hidden = tokens * d.hidden * (4 + ab)  # fp32 grad of the hidden states + their (gathered) copy
    return block + hidden + local_vocab * d.hidden * ab  # + the output weight's gradient


# ----------------------------------------------------------------------------- time


@dataclass(frozen=True)
class Hardware:
    """The device model of `auto_tune:` (the recipe holds the defaults)."""

    device_tflops: float
    matmul_efficiency: float  # achievable share of peak for large bf16 GEMMs
    tp_bandwidth_gbps: float
    dp_bandwidth_gbps: float
    #: device memory bandwidth (GB/s) for the copies the step makes besides compute: an H100
    #: SXM's HBM3 (3.35 TB/s) unless told; used for the TP gradient average's flatten and copy-back
    memory_bandwidth_gbps: float = 3350.0

    @classmethod
    def from_auto_tune(cls, at: Any) -> "Hardware":
        """From the recipe's `auto_tune:` section."""
        return cls(at.device_tflops, at.matmul_efficiency, at.tp_bandwidth_gbps, at.dp_bandwidth_gbps)


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    model_flops: float  # FLOPs per step, all ranks, without recompute (what MFU counts)
    cp_comm_s: float = 0.0  # the part of the CP K/V exchange not hidden behind attention
    encoder_comm_s: float = 0.0  # the encoder's TP all-reduces, or its own layout's gather (`encoder_comm_time`)
    #: per pipeline stage, its compute + TP, CP and encoder communication per step (the slowest
    #: one is compute_s + tp_comm_s + cp_comm_s + encoder_comm_s)
    stage_s: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.dp_comm_s + self.cp_comm_s + self.encoder_comm_s

    def mfu(self, world: int, device_tflops: float) -> float:
        """Model FLOPs utilisation of `world` devices of `device_tflops` peak each."""
        return self.model_flops / world / self.total_s / (device_tflops * 1e12)


def estimate_step_time(
    shapes: ModelShapes, freeze: list[str], layout: Layout, hw: Hardware, media_token_fraction: float = 1.0
) -> StepTime:
    """A step's time: the pipeline runs at the pace of its slowest stage (its decoder layers of
    the split, plus the encoder and connectors on the first stage and the LM head on the last),
    with a bubble of (pp-1)/(vpp*m) of that (m micro-batches per DP rank, vpp virtual stages)."""
    L, d = layout, shapes.decoder
    counts = param_counts(shapes, freeze, L.tp)
    trainable = [k for k, n in counts.trainable.items() if n > 0]
    dec, head, _ = forward_flops_per_token(shapes, L.seq_length)
    tokens_step = L.global_batch_size * L.seq_length
    # model FLOPs by the train loop's accounting (`step_flops`), for rows each filled by one
    # sample (the upper bound of sum(len^2): packed rows of shorter samples cost less attention)
    # and `media_token_fraction` of the positions taken by media (one encoder token each)
    v = shapes.encoder
    row_tiles = L.seq_length * media_token_fraction / v.patches if v is not None else 0.0
    row = step_flops(shapes, [[0, L.seq_length]], row_tiles, trainable)
    useful = row.total * L.global_batch_size
    passes = part_passes(shapes, trainable)[shapes.decoder_part]
    # where the training FLOPs run: the LM head on the last stage, the media parts on the first
    head_flops = passes.weights * tokens_step * head
    decoder_flops = row.by_part[shapes.decoder_part] * L.global_batch_size
    layer_flops = (decoder_flops - head_flops) / d.layers
    media_flops = useful - decoder_flops
    # the recomputed forward (a decoder that back-propagates): whole layers (full) or attention (selective)
    layer_forward = tokens_step * dec / d.layers * (passes.weights > 1)
    attn_share = 2 * d.heads * d.kv_channels * L.seq_length * d.layers / max(dec, 1)
    rate = hw.device_tflops * 1e12 * hw.matmul_efficiency
    enc_trainable = counts.trainable.get(shapes.encoder_part, 0) if v is not None else 0
    encoder_comm = encoder_comm_time(shapes, L, hw, media_token_fraction, enc_trainable)  # on the first stage
    split = L.estimated_split(d.layers)
    stages = []
    for stage in range(L.pp):
        n = split.stage_layers(stage)
        recomputed = sum(L.recomputed_layers(c) for c in split.counts[stage])
        rerun = recomputed if L.recompute == "full" else n * attn_share if L.recompute == "selective" else 0.0
        flops = n * layer_flops + rerun * layer_forward
        flops += media_flops if stage == 0 else 0.0
        flops += head_flops if stage == L.pp - 1 else 0.0
        compute = flops * L.pp / L.world / rate  # a stage's work is shared by its tp*cp*dp ranks
        stages.append(
            (
                compute,
                _tp_comm_time(d, L, hw, n, recomputed),
                cp_comm_time(shapes, L, hw, n),
                encoder_comm if stage == 0 else 0.0,
            )
        )
    compute, tp_comm, cp_comm, encoder_comm = max(stages, key=sum)  # the stage that paces the pipeline
    bubble = compute * (L.pp - 1) / (L.vpp * max(L.grad_accum, 1))
    dp_comm = 0.0
    replicas = L.dp * L.cp  # gradients are reduced over the data-parallel x CP group
    if replicas > 1:
        # (an encoder with its own TP holds 1/vision_tp of its weights, not 1/tp)
        grads = (counts.total_trainable / L.tp + enc_trainable * (1 / L.encoder_tp - 1 / L.tp)) / L.pp * 4
        dp_comm = 2 * (replicas - 1) / replicas * grads / (hw.dp_bandwidth_gbps * 1e9)
    return StepTime(compute, bubble, tp_comm, dp_comm, useful, cp_comm, encoder_comm, tuple(sum(t) for t in stages))


def encoder_comm_time(
    shapes: ModelShapes, L: Layout, hw: Hardware, media_token_fraction: float, trainable_params: int
) -> float:
    """The encoder's communication per step (`trainable_params`: its trainable weights, 0 when
    frozen). Inherited with TP: 2 all-reduces per layer forward (+2 backward when it trains) on its
    share's activations. Its own layout: the all-gather of every share's output, its gradient's
    all-reduce over CP, the TP all-reduces of a sharded encoder on its share; with `vision_tp` 1
    the average of its weight gradients over TP, once per step: the all-reduce, plus megatron's
    flatten into one fp32 buffer and copy back (each a read and a write of every gradient:
    `tp_grad_average_bytes`)."""
    v = shapes.encoder
    if v is None:
        return 0.0
    bw, ab = hw.tp_bandwidth_gbps * 1e9, _act_bytes(L.precision)
    trains = trainable_params > 0
    out_bytes = L.micro_batch_size * L.seq_length * media_token_fraction * v.hidden * ab  # one micro-batch's
    share_bytes = out_bytes / L.encoder_shares
    t = 0.0
    if L.encoder_tp > 1:
        t += v.layers * (2 + 2 * trains) * 2 * (L.encoder_tp - 1) / L.encoder_tp * share_bytes / bw
    if L.vision_tp is not None:
        n = L.encoder_shares
        t += (n - 1) / n * out_bytes / bw
        if trains and L.cp > 1:
            t += 2 * (L.cp - 1) / L.cp * out_bytes * L.vision_tp / L.tp / bw
    t *= L.grad_accum
    grads = tp_grad_average_bytes(L, trainable_params)
    if grads > 0:
        t += 2 * (L.tp - 1) / L.tp * grads / bw  # the all-reduce
        t += 2 * 2 * grads / (hw.memory_bandwidth_gbps * 1e9)  # flatten + copy back: read and write each
    return t


def _tp_comm_time(d: DecoderShape, L: Layout, hw: Hardware, layers: int, recomputed: int) -> float:
    """A stage's TP all-reduces per step: 2 forward + 2 backward per layer and micro-batch, and
    the recomputed forward's 2 per recomputed layer (full recompute)."""
    if L.tp <= 1:
        return 0.0
    msg = L.micro_batch_size * L.seq_length * d.hidden * _act_bytes(L.precision)
    n = (4 * layers + (2 * recomputed if L.recompute == "full" else 0)) * L.grad_accum
    return n * 2 * (L.tp - 1) / L.tp * msg / (hw.tp_bandwidth_gbps * 1e9)


def cp_comm_time(shapes: ModelShapes, L: Layout, hw: Hardware, layers: int) -> float:
    """Exposed time of the CP K/V ring per step on a stage of `layers` decoder layers: each layer
    passes every rank's K/V around the ring (cp-1 steps) in forward, K/V and their gradients in
    backward (and once more when full recompute reruns the forward), overlapped with that
    layer's attention compute."""
    if L.cp <= 1:
        return 0.0
    d = shapes.decoder
    kv_bytes = L.tokens_per_rank * 2 * d.kv_groups * d.kv_channels / L.tp * _act_bytes(L.precision)
    passes = 3 + (1 if L.recompute == "full" else 0)
    comm = layers * passes * (L.cp - 1) * kv_bytes / (hw.tp_bandwidth_gbps * 1e9)
    attn_flops = layers * L.tokens_per_rank * 2 * d.heads * d.kv_channels / L.tp * L.seq_length * passes
    attn = attn_flops / (hw.device_tflops * 1e12 * hw.matmul_efficiency)
    return max(0.0, comm - attn) * L.grad_accum


def fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f}{unit}"
    return str(int(n))


def fmt_gb(b: float) -> str:
    """Bytes in binary units with their right names ("3.62 GiB"), as every command prints them."""
    return format_bytes(b)
