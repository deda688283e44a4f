"""The model description every package reads: a family's building blocks (`ModelShapes`) and their
parameter counts. Pure arithmetic on sizes, no model built.

A family describes its model (`FamilySpec.model_shapes`) as shared building blocks, each
assigned to one of the family's trainable parts: a decoder (Qwen2/Llama-style: GQA, optional qkv
bias, RMSNorm, SwiGLU, no other biases, optionally tied head), optionally a ViT-style encoder
run on media tiles on the first pipeline stage (LayerNorm, biases, conv patch embedding, learned
positions, ln_post), and small connectors between them (e.g. a projector, a newline vector).
The FLOPs (models/flops.py) and planning's memory and step-time model (planning/cost_model.py)
are computed from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmtrain.models.lm_config import LLMConfig, padded_vocab_size


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
        return cls(
            llm.num_layers,
            llm.hidden_size,
            llm.ffn_hidden_size,
            llm.num_attention_heads,
            llm.num_query_groups,
            llm.kv_channels,
            llm.vocab_size,
            make_vocab_divisible_by,
            llm.tie_word_embeddings,
            llm.qkv_bias,
        )

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
    #: what those are, for the dry run's footnote under its parameter table
    frozen_what: str = ""

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
        return list(
            dict.fromkeys(
                ([self.encoder_part] if self.encoder else []) + [c.part for c in self.connectors] + [self.decoder_part]
            )
        )

    @property
    def upstream_parts(self) -> list[str]:
        """Parts whose output feeds the decoder (gradients flow back into them through it)."""
        return list(
            dict.fromkeys(
                ([self.encoder_part] if self.encoder else [])
                + [c.part for c in self.connectors if c.part != self.decoder_part]
            )
        )


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
    return (
        v.channels * v.patch_size**2 * v.hidden
        + v.hidden
        + v.patches * v.hidden
        + v.layers * encoder_layer_params(v)
        + 2 * v.hidden
    )


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
