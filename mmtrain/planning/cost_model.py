"""Analytical cost model: parameter counts, per-rank memory and step time from a recipe, without
building the model. `dry_run` prints it for the recipe's layout; `auto_tune` searches layouts
with it; the train loop's MFU uses `step_flops` on each step's packed layout (sum of len^2 per
sample), freeze set and media. Everything here is arithmetic on a `ModelShapes` description, so
the 2B recipe is estimated in milliseconds on a laptop.

A family describes its model (`FamilySpec.model_shapes`) as shared building blocks, each
assigned to one of the family's trainable parts: a decoder (Qwen2/Llama-style: GQA, optional qkv
bias, RMSNorm, SwiGLU, no other biases, optionally tied head), optionally a ViT-style encoder
run on media tiles on the first pipeline stage (LayerNorm, biases, conv patch embedding, learned
positions, ln_post), and small connectors between them (e.g. a projector, a newline vector).

Memory follows Megatron's accounting (Korthikanti et al. 2022; megatron's
theoretical_memory_usage): bf16 = 2 B weights + 4 B fp32 grads + 12 B fp32 main params and Adam
moments per trainable parameter, the 12 B sharded over DP with the distributed optimizer; fp32 =
4 + 4 + 8. Activations assume flash/SDPA attention (no s x s score matrix is stored), so
`selective` recompute saves little memory here; `full` keeps one layer input per layer plus one
layer's working set. Pipeline 1F1B keeps up to `pp` micro-batches in flight on the first stage.

Context parallelism (`cp`) gives each rank 1/cp of every sequence: activations, the encoder's
share of media and the loss scale with it; its K/V exchange (TE's p2p ring) is modelled as
hidden behind the attention compute where that is long enough. The LM loss follows
`parallel.lm_loss`: `plain` holds the full-vocabulary logits and their fp32 softmax; the
chunked loss (models/lm_loss.py; also the upper bound for a fused kernel) holds one vocabulary
block of logits, an fp32 hidden-state gradient and the output layer's weight gradient.

The encoder's layout (`parallel.vision.tp`, `Layout.vision_tp`): inherited (None), it is
TP-sharded like the decoder, with two all-reduces per layer forward and two backward on its
activations, and each CP rank encodes its chunk's media; with its own TP (1 or tp) its weights
are sharded over that TP only (whole with 1), the micro-batch's tiles are split over the
(tp / vision_tp) x cp ranks that share it, the outputs all-gathered (their gradients all-reduced
over CP), and a whole encoder's weight gradients averaged over TP once per step
(models/encoder_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from mmtrain.models.lm_config import LLMConfig, padded_vocab_size

GB = 1024**3  # a GiB: `auto_tune.device_memory_gb` and every memory figure are in GiB

#: dense peak TFLOP/s per device, by (name fragment, precision): the runtime's MFU denominator
#: and the default `auto_tune.device_tflops` (H100 bf16)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5},
}


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    kv_channels: int
    vocab: int
    make_vocab_divisible_by: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_llm(cls, llm: LLMConfig, make_vocab_divisible_by: int) -> "DecoderShape":
        return cls(llm.num_layers, llm.hidden_size, llm.ffn_hidden_size, llm.num_attention_heads,
                   llm.num_query_groups, llm.kv_channels, llm.vocab_size, make_vocab_divisible_by,
                   llm.tie_word_embeddings, llm.qkv_bias)

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab, self.make_vocab_divisible_by, tp)


@dataclass(frozen=True)
class EncoderShape:
    """A ViT run on every media tile (on the first pipeline stage)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    image_size: int
    patch_size: int
    channels: int
    #: parameters kept (loaded and exported) but never trained, e.g. a final norm the features skip
    frozen_params: int = 0

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class Connector:
    """A small module between the encoder and the decoder (first stage)."""

    part: str
    params: int
    matmul_params: int = 0  # weights applied to every media token (2 FLOPs each)
    #: the share of `matmul_params` in the matmul that reads the encoder's output (its input
    #: gradient is computed only when the encoder trains: `part_passes`)
    input_matmul_params: int = 0


@dataclass(frozen=True)
class ModelShapes:
    decoder: DecoderShape
    decoder_part: str  # the family part owning the decoder (embedding, layers, head)
    encoder: EncoderShape | None = None
    encoder_part: str = ""
    connectors: tuple[Connector, ...] = ()

    @property
    def flow_order(self) -> list[str]:
        """The parts in data-flow order: encoder, connectors, decoder (gradients flow backwards)."""
        return list(dict.fromkeys(([self.encoder_part] if self.encoder else [])
                                  + [c.part for c in self.connectors] + [self.decoder_part]))

    @property
    def upstream_parts(self) -> list[str]:
        """Parts whose output feeds the decoder (gradients flow back into them through it)."""
        return list(dict.fromkeys(([self.encoder_part] if self.encoder else [])
                                  + [c.part for c in self.connectors if c.part != self.decoder_part]))


# ----------------------------------------------------------------------------- parameters


def decoder_layer_params(d: DecoderShape) -> int:
    q, kv = d.heads * d.kv_channels, d.kv_groups * d.kv_channels
    qkv_out = q + 2 * kv
    attn = d.hidden * qkv_out + (qkv_out if d.qkv_bias else 0) + q * d.hidden
    mlp = d.hidden * 2 * d.ffn + d.ffn * d.hidden  # SwiGLU: gate+up, down; no biases
    return attn + mlp + 2 * d.hidden  # input + pre-MLP RMSNorm weights


def encoder_layer_params(v: EncoderShape) -> int:
    h, f = v.hidden, v.ffn
    attn = 3 * h * h + 3 * h + h * h + h
    mlp = h * f + f + f * h + h
    return attn + mlp + 2 * 2 * h  # two LayerNorms (weight + bias)


def encoder_params(v: EncoderShape) -> int:
    """Patch conv (+ bias), position table, layers, ln_post."""
    return (v.channels * v.patch_size**2 * v.hidden + v.hidden + v.patches * v.hidden
            + v.layers * encoder_layer_params(v) + 2 * v.hidden)


@dataclass
class ParamCounts:
    """Unique parameters per part (TP=1, padded vocabulary), and what `freeze:` leaves
    trainable. The decoder part includes the embedding and connectors assigned to it."""

    parts: dict[str, int]
    decoder_embedding: int
    decoder_layers: int
    trainable: dict[str, int] = field(default_factory=dict)
    #: parameters in the rows megatron adds to pad the vocabulary (embedding and untied head)
    vocab_padding: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def unpadded_total(self) -> int:
        """The count of the model with its true vocabulary: what the HF checkpoint holds (numel)."""
        return self.total - self.vocab_padding

    @property
    def total_trainable(self) -> int:
        return sum(self.trainable.values())


def param_counts(shapes: ModelShapes, freeze: list[str] = (), tp: int = 1) -> ParamCounts:
    d, v = shapes.decoder, shapes.encoder
    parts: dict[str, int] = {}
    if v is not None:
        parts[shapes.encoder_part] = encoder_params(v)
    for c in shapes.connectors:
        parts[c.part] = parts.get(c.part, 0) + c.params
    emb = d.padded_vocab(tp) * d.hidden
    layers = d.layers * decoder_layer_params(d)
    parts[shapes.decoder_part] = parts.get(shapes.decoder_part, 0) + emb + layers + d.hidden + (0 if d.tied else emb)
    trainable = {k: (0 if k in freeze else n) for k, n in parts.items()}
    if v is not None and shapes.encoder_part not in freeze:
        trainable[shapes.encoder_part] -= v.frozen_params
    padding = (d.padded_vocab(tp) - d.vocab) * d.hidden * (1 if d.tied else 2)
    return ParamCounts(parts, emb, layers, trainable, padding)


# ----------------------------------------------------------------------------- layout


def sequence_split_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What `train.seq_length` must be a multiple of for megatron to split it over CP (2*cp
    chunks) and, with sequence parallelism, each CP share over TP."""
    if cp <= 1:
        return 1
    return 2 * cp * (tp if sequence_parallel and tp > 1 else 1)


@dataclass(frozen=True)
class Layout:
    """What the memory/time model needs from a recipe; auto_tune varies tp/pp/cp/mbs/recompute."""

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
        return cls(p.tp, p.pp, p.dp, t.micro_batch_size, t.global_batch_size, t.seq_length, p.recompute,
                   p.sequence_parallel and p.tp > 1, p.distributed_optimizer, p.precision, p.cp, p.lm_loss,
                   p.lm_loss_block_mb, recompute_num_layers=p.recompute_num_layers if p.recompute == "full" else 0,
                   vision_tp=p.vision.tp)

    @property
    def encoder_tp(self) -> int:
        """TP of the encoder's weights."""
        return self.tp if self.vision_tp is None else self.vision_tp

    @property
    def encoder_shares(self) -> int:
        """Ranks that split one micro-batch's media between them: the CP ranks (each its chunk's)
        when inherited, every (tp / vision_tp) x cp rank with the encoder's own layout."""
        return self.cp if self.vision_tp is None else self.tp // self.vision_tp * self.cp

    def recomputed_layers(self, stage_layers: int) -> int:
        """Decoder layers of a stage whose activations are recomputed (full recompute)."""
        if self.recompute != "full":
            return 0
        return min(self.recompute_num_layers, stage_layers) if self.recompute_num_layers else stage_layers

    def with_(self, **kw: Any) -> "Layout":
        return replace(self, **kw)


# ----------------------------------------------------------------------------- memory


@dataclass
class MemoryEstimate:
    """Bytes on the busiest rank (the pipeline stage with the largest total)."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    encoder_activations: float
    params_on_rank: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.encoder_activations


def _stage_layers(layers: int, pp: int, stage: int) -> int:
    return layers // pp + (1 if stage < layers % pp else 0)


def _act_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


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


def estimate_memory(shapes: ModelShapes, freeze: list[str], layout: Layout,
                    media_token_fraction: float = 1.0) -> MemoryEstimate:
    d, v, L = shapes.decoder, shapes.encoder, layout
    counts = param_counts(shapes, freeze, L.tp)
    frozen = {k: counts.trainable[k] == 0 for k in counts.parts}
    dec_frozen = frozen[shapes.decoder_part]
    ab = _act_bytes(L.precision)
    tokens = L.tokens_per_rank
    w_bytes, g_bytes, o_bytes = (2, 4, 12) if L.precision == "bf16" else (4, 4, 8)
    o_share = 1 / (L.dp * L.cp) if L.distributed_optimizer else 1.0  # sharded over the DP x CP group
    in_flight = lambda stage: min(L.pp - stage, L.grad_accum)  # noqa: E731  (1F1B warm-up depth)

    best: MemoryEstimate | None = None
    for stage in range(L.pp):
        n_layers = _stage_layers(d.layers, L.pp, stage)
        first, last = stage == 0, stage == L.pp - 1
        parts: list[tuple[float, bool]] = [(n_layers * decoder_layer_params(d) / L.tp, dec_frozen)]
        if first:
            parts.append((counts.decoder_embedding / L.tp, dec_frozen))
            if v is not None:
                parts.append((encoder_params(v) / L.encoder_tp, frozen[shapes.encoder_part]))
            parts += [(c.params / L.tp, frozen[c.part]) for c in shapes.connectors]
        if last:
            out = counts.decoder_embedding / L.tp
            if not d.tied or (L.pp > 1):  # untied head, or the tied copy megatron keeps on the last stage
                parts.append((out, dec_frozen))
            parts.append((d.hidden, dec_frozen))
        n_params = sum(n for n, _ in parts)
        n_train = sum(n for n, fz in parts if not fz)
        weights = n_params * w_bytes
        grads = n_train * g_bytes
        optimizer = n_train * o_bytes * o_share

        # decoder activations; a frozen decoder still back-propagates to the parts feeding it
        needs_backward = not all(frozen.values())
        per_layer = decoder_layer_activation_elems(d, L.tp, L.sequence_parallel) * tokens * ab
        # + one layer's working set: the forward's live tensors, or a backward step's gradients
        if not needs_backward:
            acts = per_layer
        elif L.recompute == "full":
            layer_input = d.hidden / (L.tp if L.sequence_parallel else 1) * tokens * ab
            n_rc = L.recomputed_layers(n_layers)  # the rest keep their activations
            acts = (n_rc * layer_input + (n_layers - n_rc) * per_layer) * in_flight(stage) + per_layer
        else:
            acts = n_layers * per_layer * in_flight(stage) + per_layer
        logits = lm_loss_bytes(d, L, tokens) if last else 0.0
        enc = 0.0
        if first and v is not None:
            batch_media = L.micro_batch_size * L.seq_length * media_token_fraction  # encoder tokens
            elayer = encoder_layer_activation_elems(v, L.encoder_tp) * batch_media / L.encoder_shares * ab
            trains_encoder = not frozen[shapes.encoder_part]
            enc = (v.layers * elayer * in_flight(stage)) if trains_encoder else elayer
            if L.vision_tp is not None:  # + every share's output, gathered (kept for the projector)
                enc += batch_media * v.hidden * ab * (in_flight(stage) if trains_encoder else 1)
        est = MemoryEstimate(stage, weights, grads, optimizer, acts, logits, enc, int(n_params))
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


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

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.dp_comm_s + self.cp_comm_s + self.encoder_comm_s

    def mfu(self, world: int, device_tflops: float) -> float:
        """Model FLOPs utilisation of `world` devices of `device_tflops` peak each."""
        return self.model_flops / world / self.total_s / (device_tflops * 1e12)


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
    (mmdata.energon_loaders.balance); 0 for a family without an encoder."""
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


# ----------------------------------------------------------------------------- FLOPs of a step


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


def executed_lengths(cu_seqlens: Any, pad_to: int = 1) -> list[int]:
    """Segment lengths of one `cu_seqlens` (a micro-batch's flattened stream or one row) as the
    device runs them: every non-empty segment (a packed sample or a padding run; THD attention
    runs over each) padded up to `pad_to` (context parallelism pads each to 2*cp*tp:
    models/context_parallel.py). Takes a host tensor or a list; never reads a device."""
    cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    return [-(-n // pad_to) * pad_to for n in lens] if pad_to > 1 else lens


def _decoder_forward(d: DecoderShape, tokens: int, sum_sq: int) -> PartFlops:
    """Layers (2 FLOPs per weight per token; causal attention 2*q*len^2 per sample: half of the
    4*q*len^2 of Q K^T + P V over a full len x len matrix) + the LM head on every position."""
    q = d.heads * d.kv_channels
    return PartFlops(weights=tokens * (d.layers * 2 * decoder_layer_params(d) + 2 * d.hidden * d.padded_vocab(1)),
                     core=d.layers * 2 * q * sum_sq)


def _media_forward(shapes: ModelShapes, tiles: int) -> dict[str, PartFlops]:
    """Encoder + connectors on `tiles` tiles/frames: each tile is `patches` tokens through the
    patch conv, every layer (full attention over the tile: 4*h*patches^2) and the connectors."""
    v = shapes.encoder
    if v is None or tiles <= 0:
        return {}
    n = tiles * v.patches
    out = {shapes.encoder_part: PartFlops(
        weights=n * v.layers * 2 * encoder_layer_params(v),
        core=tiles * v.layers * 4 * v.hidden * v.patches**2,
        inputs=n * 2 * v.channels * v.patch_size**2 * v.hidden,
    )}
    for c in shapes.connectors:
        f = PartFlops(weights=2.0 * n * (c.matmul_params - c.input_matmul_params), inputs=2.0 * n * c.input_matmul_params)
        out[c.part] = out.get(c.part, PartFlops()) + f
    return out


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one step's micro-batches (one model replica's share of the global batch)."""

    by_part: dict[str, float]  # training FLOPs per part (passes applied)
    forward: float  # forward FLOPs of all parts
    tokens: int  # decoder positions executed (CP padding included)
    sum_len_sq: int  # sum of len^2 over the executed segments
    tiles: int  # tiles/frames through the encoder

    @property
    def total(self) -> float:
        return sum(self.by_part.values())


def step_flops(shapes: ModelShapes, cu_seqlens: Iterable[Any], tiles: int, trainable_parts: Iterable[str],
               *, pad_to: int = 1) -> StepFlops:
    """Training FLOPs of one step from its real packed layout: `cu_seqlens` holds one host
    `cu_seqlens` per micro-batch (or per row: segments never cross rows), `tiles` the tiles/frames
    the encoder runs on, `trainable_parts` the parts not frozen, `pad_to` the CP padding multiple
    (`models.context_parallel.padding_multiple(cp, tp)`; 1 without CP). Decoder matmuls and the LM
    head scale with the executed positions, causal attention with sum(len_i^2) of the samples
    (THD attention runs per packed sample), the encoder with `tiles`; each part's backward
    follows `part_passes`. The train loop's MFU (runtime/throughput.py) and benchmarks call it."""
    tokens = sum_sq = 0
    for cu in cu_seqlens:
        lens = executed_lengths(cu, pad_to)
        tokens += sum(lens)
        sum_sq += sum(n * n for n in lens)
    fwd = {shapes.decoder_part: _decoder_forward(shapes.decoder, tokens, sum_sq)}
    for part, f in _media_forward(shapes, tiles).items():
        fwd[part] = fwd.get(part, PartFlops()) + f
    passes = part_passes(shapes, trainable_parts)
    by_part = {part: passes[part].apply(f) for part, f in fwd.items()}
    return StepFlops(by_part, sum(f.total for f in fwd.values()), tokens, sum_sq, int(tiles))


def estimate_step_time(shapes: ModelShapes, freeze: list[str], layout: Layout, hw: Hardware,
                       media_token_fraction: float = 1.0) -> StepTime:
    L = layout
    counts = param_counts(shapes, freeze, L.tp)
    trainable = [k for k, n in counts.trainable.items() if n > 0]
    dec, head, media = forward_flops_per_token(shapes, L.seq_length)
    tokens_step = L.global_batch_size * L.seq_length
    # model FLOPs by the train loop's accounting (`step_flops`), for rows each filled by one
    # sample (the upper bound of sum(len^2): packed rows of shorter samples cost less attention)
    # and `media_token_fraction` of the positions taken by media (one encoder token each)
    v = shapes.encoder
    row_tiles = L.seq_length * media_token_fraction / v.patches if v is not None else 0.0
    useful = step_flops(shapes, [[0, L.seq_length]], row_tiles, trainable).total * L.global_batch_size
    dec_backward = part_passes(shapes, trainable)[shapes.decoder_part].weights > 1
    layers_per_stage = shapes.decoder.layers / L.pp
    recompute_fwd = {"full": L.recomputed_layers(round(layers_per_stage)) / layers_per_stage,
                     "selective": 0.0, "none": 0.0}[L.recompute]
    attn_share = (2 * shapes.decoder.heads * shapes.decoder.kv_channels * L.seq_length * shapes.decoder.layers) / max(dec, 1)
    if L.recompute == "selective":
        recompute_fwd = attn_share
    flops = useful + tokens_step * dec * recompute_fwd * dec_backward  # + the recomputed decoder forward
    world = L.world
    compute = flops / world / (hw.device_tflops * 1e12 * hw.matmul_efficiency)
    bubble = compute * (L.pp - 1) / max(L.grad_accum, 1)
    d = shapes.decoder
    ab = _act_bytes(L.precision)
    tp_comm = 0.0
    if L.tp > 1:
        msg = L.micro_batch_size * L.seq_length * d.hidden * ab
        # 2 fwd + 2 bwd all-reduce(-equivalents), and the recomputed forward's 2
        per_layer = 4 + (2 * recompute_fwd if L.recompute == "full" else 0)
        n = per_layer * d.layers / L.pp * L.grad_accum
        tp_comm = n * 2 * (L.tp - 1) / L.tp * msg / (hw.tp_bandwidth_gbps * 1e9)
    dp_comm = 0.0
    replicas = L.dp * L.cp  # gradients are reduced over the data-parallel x CP group
    enc_trainable = counts.trainable.get(shapes.encoder_part, 0) if v is not None else 0
    if replicas > 1:
        # (an encoder with its own TP holds 1/vision_tp of its weights, not 1/tp)
        grads = (counts.total_trainable / L.tp + enc_trainable * (1 / L.encoder_tp - 1 / L.tp)) / L.pp * 4
        dp_comm = 2 * (replicas - 1) / replicas * grads / (hw.dp_bandwidth_gbps * 1e9)
    return StepTime(compute, bubble, tp_comm, dp_comm, useful, cp_comm_time(shapes, L, hw),
                    encoder_comm_time(shapes, L, hw, media_token_fraction, enc_trainable))


def encoder_comm_time(shapes: ModelShapes, L: Layout, hw: Hardware, media_token_fraction: float,
                      trainable_params: int) -> float:
    """The encoder's communication per step (`trainable_params`: its trainable weights, 0 when
    frozen). Inherited with TP: 2 all-reduces per layer forward (+2 backward when it trains) on its
    share's activations. Its own layout: the all-gather of every share's output, its gradient's
    all-reduce over CP, the TP all-reduces of a sharded encoder on its share; with `vision_tp` 1
    the average of its weight gradients over TP, once per step."""
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
    if trains and L.vision_tp == 1 and L.tp > 1:
        t += 2 * (L.tp - 1) / L.tp * trainable_params * 4 / bw
    return t


def cp_comm_time(shapes: ModelShapes, L: Layout, hw: Hardware) -> float:
    """Exposed time of the CP K/V ring per step: each layer passes every rank's K/V around the
    ring (cp-1 steps) in forward, K/V and their gradients in backward (and once more when full
    recompute reruns the forward), overlapped with that layer's attention compute."""
    if L.cp <= 1:
        return 0.0
    d = shapes.decoder
    kv_bytes = L.tokens_per_rank * 2 * d.kv_groups * d.kv_channels / L.tp * _act_bytes(L.precision)
    passes = 3 + (1 if L.recompute == "full" else 0)
    layers = d.layers / L.pp
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
    from mmdata.units import format_bytes

    return format_bytes(b)
