"""Analytical cost model: parameter counts, per-rank memory and step time from a recipe, without
building the model. `dry_run` prints it for the recipe's layout; `auto_tune` searches layouts
with it. Everything here is arithmetic on the config, so the 2B recipe is estimated in
milliseconds on a laptop.

Shapes are read by duck typing from the family's model config: the decoder from `cfg.llm` (or
`cfg` itself), and, when present, a vision tower `cfg.vision` with a `cfg.projector`. Counts
follow the modules mmtrain builds (mmtrain/llava_ov): Qwen2 decoder (GQA, optional qkv bias,
RMSNorm, SwiGLU, no other biases), SigLIP tower (LayerNorm, biases, conv patch embedding,
learned positions, ln_post), 2-layer MLP projector, an `image_newline` vector.

Memory follows Megatron's accounting (Korthikanti et al. 2022; megatron's
theoretical_memory_usage): bf16 = 2 B weights + 4 B fp32 grads + 12 B fp32 main params and Adam
moments per trainable parameter, the 12 B sharded over DP with the distributed optimizer; fp32 =
4 + 4 + 8. Activations assume flash/SDPA attention (no s x s score matrix is stored), so
`selective` recompute saves little memory here; `full` keeps one layer input per layer plus one
layer's working set. Pipeline 1F1B keeps up to `pp` micro-batches in flight on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

GB = 1024**3


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

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_divisible_by * tp
        return -(-self.vocab // multiple) * multiple


@dataclass(frozen=True)
class VisionShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    image_size: int
    patch_size: int
    channels: int

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class ModelShapes:
    decoder: DecoderShape
    vision: VisionShape | None = None
    projector_bias: bool = True


def model_shapes(cfg: Any) -> ModelShapes:
    llm = getattr(cfg, "llm", cfg)
    heads = llm.num_attention_heads
    decoder = DecoderShape(
        layers=llm.num_layers, hidden=llm.hidden_size, ffn=llm.ffn_hidden_size, heads=heads,
        kv_groups=getattr(llm, "num_query_groups", None) or heads,
        kv_channels=getattr(llm, "kv_channels", None) or llm.hidden_size // heads,
        vocab=llm.vocab_size,
        make_vocab_divisible_by=getattr(cfg, "make_vocab_size_divisible_by", 128),
        tied=bool(getattr(llm, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(llm, "qkv_bias", False)),
    )
    v = getattr(cfg, "vision", None)
    if v is None:
        return ModelShapes(decoder)
    vision = VisionShape(v.num_layers, v.hidden_size, v.ffn_hidden_size, v.num_attention_heads,
                         v.image_size, v.patch_size, getattr(v, "num_channels", 3))
    proj = getattr(cfg, "projector", None)
    return ModelShapes(decoder, vision, bool(getattr(proj, "bias", True)))


# ----------------------------------------------------------------------------- parameters


def decoder_layer_params(d: DecoderShape) -> int:
    q, kv = d.heads * d.kv_channels, d.kv_groups * d.kv_channels
    qkv_out = q + 2 * kv
    attn = d.hidden * qkv_out + (qkv_out if d.qkv_bias else 0) + q * d.hidden
    mlp = d.hidden * 2 * d.ffn + d.ffn * d.hidden  # SwiGLU: gate+up, down; no biases
    return attn + mlp + 2 * d.hidden  # input + pre-MLP RMSNorm weights


def vision_layer_params(v: VisionShape) -> int:
    h, f = v.hidden, v.ffn
    attn = 3 * h * h + 3 * h + h * h + h
    mlp = h * f + f + f * h + h
    return attn + mlp + 2 * 2 * h  # two LayerNorms (weight + bias)


@dataclass
class ParamCounts:
    """Unique parameters per component (TP=1, padded vocabulary), and what the freeze leaves
    trainable. `llm` includes the embedding and `image_newline` (frozen with the LLM)."""

    vision_tower: int
    projector: int
    llm: int
    llm_embedding: int
    llm_layers: int
    trainable: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.vision_tower + self.projector + self.llm

    @property
    def total_trainable(self) -> int:
        return sum(self.trainable.values())

    @property
    def components(self) -> dict[str, int]:
        return {"vision_tower": self.vision_tower, "projector": self.projector, "llm": self.llm}


def param_counts(shapes: ModelShapes, freeze: Any = None, tp: int = 1) -> ParamCounts:
    d, v = shapes.decoder, shapes.vision
    emb = d.padded_vocab(tp) * d.hidden
    layers = d.layers * decoder_layer_params(d)
    llm = emb + layers + d.hidden + (0 if d.tied else emb)
    vision = projector = 0
    if v is not None:
        vision = (v.channels * v.patch_size**2 * v.hidden + v.hidden + v.patches * v.hidden
                  + v.layers * vision_layer_params(v) + 2 * v.hidden)
        bias = shapes.projector_bias
        projector = v.hidden * d.hidden + d.hidden * d.hidden + (2 * d.hidden if bias else 0)
        llm += d.hidden  # image_newline
    counts = ParamCounts(vision, projector, llm, emb, layers)
    frozen = {name: bool(getattr(freeze, name, False)) for name in counts.components}
    counts.trainable = {k: (0 if frozen[k] else n) for k, n in counts.components.items()}
    return counts


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """What the memory/time model needs from a recipe; auto_tune varies tp/pp/mbs/recompute."""

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

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def grad_accum(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @classmethod
    def from_recipe(cls, recipe: Any) -> "Layout":
        p, t = recipe.parallel, recipe.train
        return cls(p.tp, p.pp, p.dp, t.micro_batch_size, t.global_batch_size, t.seq_length, p.recompute,
                   p.sequence_parallel and p.tp > 1, p.distributed_optimizer, p.precision)

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
    vision_activations: float
    params_on_rank: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.vision_activations

    def as_gb(self) -> dict[str, float]:
        keys = ("weights", "grads", "optimizer", "activations", "vision_activations", "logits")
        return {k: getattr(self, k) / GB for k in keys} | {"total": self.total / GB}


def _stage_layers(layers: int, pp: int, stage: int) -> int:
    return layers // pp + (1 if stage < layers % pp else 0)


def _act_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def decoder_layer_activation_elems(d: DecoderShape, tp: int, sp: bool) -> float:
    """Elements kept per token by one decoder layer for backward (no recompute)."""
    q, kv = d.heads * d.kv_channels, d.kv_groups * d.kv_channels
    replicated = 4 * d.hidden  # two norm inputs + two norm outputs (split only with SP)
    sharded = (q + 2 * kv) + q + 2 * d.ffn + d.ffn  # qkv, attention out, fc1 out, SwiGLU out
    return replicated / (tp if sp else 1) + sharded / tp


def vision_layer_activation_elems(v: VisionShape, tp: int) -> float:
    return 4 * v.hidden + (3 * v.hidden + v.hidden + 2 * v.ffn) / tp


def estimate_memory(shapes: ModelShapes, freeze: Any, layout: Layout, media_token_fraction: float = 1.0) -> MemoryEstimate:
    d, v, L = shapes.decoder, shapes.vision, layout
    counts = param_counts(shapes, freeze, L.tp)
    frozen = {k: counts.trainable[k] == 0 for k in counts.components}
    ab = _act_bytes(L.precision)
    tokens = L.micro_batch_size * L.seq_length
    w_bytes, g_bytes, o_bytes = (2, 4, 12) if L.precision == "bf16" else (4, 4, 8)
    o_share = 1 / L.dp if L.distributed_optimizer else 1.0
    in_flight = lambda stage: min(L.pp - stage, L.grad_accum)  # noqa: E731  (1F1B warm-up depth)

    best: MemoryEstimate | None = None
    for stage in range(L.pp):
        n_layers = _stage_layers(d.layers, L.pp, stage)
        first, last = stage == 0, stage == L.pp - 1
        parts: list[tuple[float, bool]] = [(n_layers * decoder_layer_params(d) / L.tp, frozen["llm"])]
        if first:
            parts.append((counts.llm_embedding / L.tp, frozen["llm"]))
            parts.append((counts.vision_tower / L.tp, frozen["vision_tower"]))
            parts.append((counts.projector / L.tp, frozen["projector"]))
        if last:
            out = counts.llm_embedding / L.tp
            if not d.tied or (L.pp > 1):  # untied head, or the tied copy megatron keeps on the last stage
                parts.append((out, frozen["llm"]))
            parts.append((d.hidden, frozen["llm"]))
        n_params = sum(n for n, _ in parts)
        n_train = sum(n for n, fz in parts if not fz)
        weights = n_params * w_bytes
        grads = n_train * g_bytes
        optimizer = n_train * o_bytes * o_share

        # decoder activations; frozen LLM still back-propagates to the projector unless it is frozen too
        needs_backward = not frozen["llm"] or (not frozen["projector"] or not frozen["vision_tower"])
        per_layer = decoder_layer_activation_elems(d, L.tp, L.sequence_parallel) * tokens * ab
        if not needs_backward:
            acts = per_layer  # forward only: one layer's working set
        elif L.recompute == "full":
            layer_input = d.hidden / (L.tp if L.sequence_parallel else 1) * tokens * ab
            acts = n_layers * layer_input * in_flight(stage) + per_layer
        else:
            acts = n_layers * per_layer * in_flight(stage)
        logits = tokens * d.padded_vocab(L.tp) / L.tp * (ab + 4) if last else 0.0  # logits + fp32 softmax
        vis = 0.0
        if first and v is not None:
            vis_tokens = tokens * media_token_fraction
            vlayer = vision_layer_activation_elems(v, L.tp) * vis_tokens * ab
            trains_vision = not frozen["vision_tower"]
            vis = (v.layers * vlayer * in_flight(stage)) if trains_vision else vlayer
        est = MemoryEstimate(stage, weights, grads, optimizer, acts, logits, vis, int(n_params))
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


# ----------------------------------------------------------------------------- time


@dataclass(frozen=True)
class Hardware:
    device_tflops: float = 989.0
    matmul_efficiency: float = 0.6  # achievable share of peak for large bf16 GEMMs
    tp_bandwidth_gbps: float = 450.0
    dp_bandwidth_gbps: float = 25.0

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

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.dp_comm_s

    def mfu(self, world: int, device_tflops: float) -> float:
        """Model FLOPs utilisation of `world` devices of `device_tflops` peak each."""
        return self.model_flops / world / self.total_s / (device_tflops * 1e12)


def forward_flops_per_token(shapes: ModelShapes, seq_length: int) -> tuple[float, float, float]:
    """(decoder matmuls + causal attention, LM head, vision tower + projector per vision token)."""
    d, v = shapes.decoder, shapes.vision
    q = d.heads * d.kv_channels
    decoder = d.layers * (2 * decoder_layer_params(d) + 2 * q * seq_length)  # QK^T + AV, causal half
    head = 2 * d.hidden * d.padded_vocab(1)
    vision = 0.0
    if v is not None:
        proj = v.hidden * d.hidden + d.hidden * d.hidden
        vision = v.layers * (2 * vision_layer_params(v) + 4 * v.hidden * v.patches) + 2 * proj
    return decoder, head, vision


def training_flops_per_token(cfg: Any, seq_length: int) -> float:
    """Decoder training FLOPs per token for the train loop's MFU: 3 x (forward + backward) the
    decoder and LM-head forward of `forward_flops_per_token`. The vision tower is left out: its
    share depends on the tiles of each step, which the loop does not track per token."""
    decoder, head, _ = forward_flops_per_token(model_shapes(cfg), seq_length)
    return 3.0 * (decoder + head)


def estimate_step_time(shapes: ModelShapes, freeze: Any, layout: Layout, hw: Hardware,
                       media_token_fraction: float = 1.0) -> StepTime:
    L = layout
    counts = param_counts(shapes, freeze, L.tp)
    trains = {k: n > 0 for k, n in counts.trainable.items()}
    dec, head, vis = forward_flops_per_token(shapes, L.seq_length)
    tokens_step = L.global_batch_size * L.seq_length
    # backward ~ 2x forward for weights+inputs; a frozen part that still passes gradients back
    # does ~1x (input grads only); a part nothing upstream of which trains does none.
    llm_bwd = 2.0 if trains["llm"] else (1.0 if trains["projector"] or trains["vision_tower"] else 0.0)
    vis_bwd = 2.0 if trains["vision_tower"] else 0.0
    recompute_fwd = {"full": 1.0, "selective": 0.0, "none": 0.0}[L.recompute]
    attn_share = (2 * shapes.decoder.heads * shapes.decoder.kv_channels * L.seq_length * shapes.decoder.layers) / max(dec, 1)
    if L.recompute == "selective":
        recompute_fwd = attn_share
    flops = tokens_step * ((dec + head) * (1 + llm_bwd) + dec * recompute_fwd * (llm_bwd > 0)
                           + vis * media_token_fraction * (1 + vis_bwd))
    useful = tokens_step * ((dec + head) * (1 + llm_bwd) + vis * media_token_fraction * (1 + vis_bwd))
    world = L.world
    compute = flops / world / (hw.device_tflops * 1e12 * hw.matmul_efficiency)
    bubble = compute * (L.pp - 1) / max(L.grad_accum, 1)
    d = shapes.decoder
    ab = _act_bytes(L.precision)
    tp_comm = 0.0
    if L.tp > 1:
        msg = L.micro_batch_size * L.seq_length * d.hidden * ab
        per_layer = 4 + (2 if L.recompute == "full" else 0)  # 2 fwd + 2 bwd all-reduce(-equivalents)
        n = per_layer * d.layers / L.pp * L.grad_accum
        tp_comm = n * 2 * (L.tp - 1) / L.tp * msg / (hw.tp_bandwidth_gbps * 1e9)
    dp_comm = 0.0
    if L.dp > 1:
        grads = counts.total_trainable / (L.tp * L.pp) * 4
        dp_comm = 2 * (L.dp - 1) / L.dp * grads / (hw.dp_bandwidth_gbps * 1e9)
    return StepTime(compute, bubble, tp_comm, dp_comm, useful)


def fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f}{unit}"
    return str(int(n))


def fmt_gb(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= GB / 100 or b == 0 else f"{b / 1024**2:.1f} MB"
