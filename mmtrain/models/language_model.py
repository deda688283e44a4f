"""The decoder as a megatron-core `GPTModel` on the local layer spec, and the pieces around it
every family's model uses: token embedding of (this CP rank's share of) a packed batch, the
decoder stage run to per-token loss (over the true, unpadded vocabulary) or logits
(`packed_decoder_forward`: CP split, SP scatter, lean loss), HF-style attention masks as packed
segments, and megatron's TP tags for models built without random init.

Packed sequences run in megatron's THD layout: the [B, S] batch is flattened to one [B*S] stream
and `cu_seqlens` (one segment per packed sample / padding run) drives both RoPE (positions
restart per segment) and attention (no attention across segments), as TE/flash-attn do on GPU.
With context parallelism each rank runs its share of that stream (`context_parallel.py`).

The loss (`DecoderLM`, when labels are given): by default the memory-lean blocked output
projection + cross-entropy of `lm_loss.py` (or a fused GPU kernel), never the full-vocabulary
logits; `parallel.lm_loss: plain` keeps megatron's own output layer + vocab-parallel cross
entropy (the reference the lean loss is tested against).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmtrain.models.context_parallel import CPLayout
from mmtrain.models.layer_specs import decoder_layer_spec
from mmtrain.models.lm_config import LLMConfig
from mmtrain.models.lm_loss import DEFAULT_BLOCK_MB, fused_kernel, linear_cross_entropy, plain_loss_fusion
from mmtrain.models.norm import TorchNorm
from mmtrain.models.te_support import have_te

if TYPE_CHECKING:
    from mmdata.energon_loaders.batch import PackedBatch


class DecoderLM(GPTModel):
    """megatron's `GPTModel` whose loss never materialises the full-vocabulary logits.

    `forward(..., labels=[b, s])` returns the per-token loss `[b, s]` (fp32; 0 where the label
    is < 0, e.g. IGNORE_INDEX) over the true vocabulary `true_vocab`; without labels it returns
    logits exactly as `GPTModel` does. The weights, their names and everything else are
    `GPTModel`'s."""

    def __init__(
        self,
        *args: Any,
        true_vocab: int,
        loss_impl: str = "chunked",
        loss_block_mb: int = DEFAULT_BLOCK_MB,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.true_vocab = true_vocab
        self.loss_impl = loss_impl
        self.loss_block_mb = loss_block_mb

    def _postprocess(self, hidden_states: torch.Tensor, **kw: Any) -> torch.Tensor:
        labels = kw.get("labels")
        if labels is None or not self.post_process or self.config.mtp_num_layers:
            return super()._postprocess(hidden_states=hidden_states, **kw)
        if self.loss_impl == "plain":
            loss = self._plain_loss(hidden_states, labels, kw)
        else:
            loss = self._lean_loss(hidden_states, labels)
        return loss * (labels >= 0)

    def _plain_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, kw: dict) -> torch.Tensor:
        """megatron's output layer + vocab-parallel cross entropy (full logits); TE's fused cross
        entropy when the run is on CUDA with TE (decided on the hidden states' device: the run's)."""
        for field, value in plain_loss_fusion(hidden_states.device.type == "cuda", have_te()).items():
            setattr(self.config, field, value)  # read by megatron's compute_language_model_loss per call
        target = labels.clamp(min=0)
        if self.vocab_size == self.true_vocab:
            return super()._postprocess(hidden_states=hidden_states, **{**kw, "labels": target})
        logits = super()._postprocess(
            hidden_states=hidden_states, **{**kw, "labels": None, "runtime_gather_output": False}
        )
        return vocab_parallel_loss(logits, target, self.true_vocab)

    def _lean_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Blocked (or fused) output projection + cross entropy: [s, b, h] -> [b, s] losses."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.config.sequence_parallel and tp > 1:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states, True, group=tp_group)
        elif tp > 1:
            hidden_states = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        hidden = hidden_states.transpose(0, 1).reshape(-1, hidden_states.size(-1))  # [b*s, h], labels' order
        flat_labels = labels.reshape(-1)
        if self.loss_impl == "fused":
            kernel = fused_kernel(hidden.dtype, hidden.device)
            if kernel is None or tp > 1:
                raise RuntimeError("parallel.lm_loss=fused needs a working fused kernel and TP = 1")
            loss = kernel[1](hidden, weight[: self.true_vocab], flat_labels).float()
        else:
            loss = linear_cross_entropy(
                hidden,
                weight,
                flat_labels,
                vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.size(0),
                true_vocab=self.true_vocab,
                block_mb=self.loss_block_mb,
                group=tp_group if tp > 1 else None,
            )
        return loss.view(labels.shape)


def build_language_model(
    llm: LLMConfig,
    lm_config: TransformerConfig,
    *,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    parallel_output: bool = True,
    loss_impl: str = "chunked",
    loss_block_mb: int = DEFAULT_BLOCK_MB,
) -> DecoderLM:
    """The decoder as a megatron `GPTModel` (`vocab_size`: the padded table size)."""
    block = TransformerBlockSubmodules(
        layer_specs=[
            decoder_layer_spec(
                getattr(lm_config, "transformer_impl", "local"), context_parallel=lm_config.context_parallel_size > 1
            )
        ]
        * get_num_layers_to_build(lm_config, vp_stage=vp_stage),
        layer_norm=TorchNorm,
    )
    theta = llm.rope_theta
    return DecoderLM(
        config=lm_config,
        transformer_layer_spec=block,
        vocab_size=vocab_size,
        max_sequence_length=llm.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=llm.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        scatter_embedding_sequence_parallel=False,
        vp_stage=vp_stage,
        true_vocab=llm.vocab_size,
        loss_impl=loss_impl,
        loss_block_mb=loss_block_mb,
    )


def embed_tokens(lm: DecoderLM, batch: PackedBatch, layout: CPLayout) -> torch.Tensor:
    """Token embeddings of this CP rank's share of the batch's stream, [t_local, 1, h] (not yet
    scattered for sequence parallelism: a family may splice media features in first)."""
    ids = layout.split(batch.input_ids.reshape(-1))
    return lm.embedding(input_ids=ids[None], position_ids=None)


def packed_decoder_forward(
    lm: DecoderLM,
    batch: PackedBatch,
    layout: CPLayout,
    decoder_input: Optional[torch.Tensor] = None,
    return_logits: bool = False,
) -> torch.Tensor:
    """The decoder stage on a packed batch in THD layout, this CP rank's share of it.

    First stage: `decoder_input` is this rank's embedded share ([t_local, 1, h], e.g. with media
    spliced in; default: the token embeddings); it is scattered for sequence parallelism here.
    Last stage: the per-token loss `[B, S]` (0 where the label is IGNORE_INDEX and at positions
    other CP ranks hold), or with `return_logits` the logits `[B, S, vocab]` gathered over TP
    (no CP). Other stages: the hidden states for the next stage."""
    b, s = batch.input_ids.shape
    if return_logits and layout.cp > 1:
        raise NotImplementedError("return_logits is not available under context parallelism")
    if lm.pre_process:
        if decoder_input is None:
            decoder_input = embed_tokens(lm, batch, layout)
        if lm.config.sequence_parallel:
            decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
    labels = None
    if lm.post_process and not return_logits:
        labels = layout.split(batch.labels.reshape(-1), fill=IGNORE_INDEX)[None]
    out = lm(
        input_ids=None,
        position_ids=None,
        attention_mask=None,
        decoder_input=decoder_input,
        labels=labels,
        packed_seq_params=layout.packed_seq_params(batch.input_ids.device),
        runtime_gather_output=True if return_logits else None,
    )
    if not lm.post_process:
        return out
    if return_logits:
        return out.reshape(b, s, -1)[..., : lm.true_vocab]
    return layout.scatter(out.reshape(-1)).view(b, s)


def segments_from_attention_mask(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF-style [B, S] attention mask (1 = token, right padding) -> (cu_seqlens over the
    flattened B*S stream with one segment per row's tokens and one per its padding, position ids
    restarting per row), so HF-style calls run as packed batches."""
    b, s = attention_mask.shape
    lens: list[int] = []
    pos = torch.zeros((b, s), dtype=torch.long)
    for r in range(b):
        row = attention_mask[r].to(torch.bool)
        valid = int(row.sum())
        if valid and not bool(row[:valid].all()):
            raise ValueError(
                f"attention_mask row {r} is left-padded or holey; use right padding (processor padding_side='right')"
            )
        lens += [valid] if valid == s else ([valid, s - valid] if valid else [s])
        pos[r, :valid] = torch.arange(valid)
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32), pos


def hf_text_fields(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> dict[str, Any]:
    """The packed-batch text fields of an HF-style call: `input_ids` [B, S] (+ right-padded
    `attention_mask`, default all ones), each row one sample, its padding a segment of its own,
    no labels (inference)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cu, pos = segments_from_attention_mask(attention_mask)
    return dict(
        input_ids=input_ids.long(),
        labels=torch.full_like(input_ids, IGNORE_INDEX, dtype=torch.long),
        position_ids=pos,
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
    )


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Per-token cross entropy over the TRUE vocabulary: logits [1, T, V/tp] (this rank's slice
    of a padded table), labels [1, T]. The padding rows would otherwise enter the softmax."""
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    cols = torch.arange(start, start + part, device=logits.device)
    logits = logits.masked_fill(cols >= true_vocab, float("-inf"))
    return tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), labels.transpose(0, 1)
    ).transpose(0, 1)


def restore_tp_attributes(module: torch.nn.Module) -> None:
    """megatron tags TP-sharded weights (`tensor_model_parallel`, `partition_dim`) only while
    initialising them on CPU; with `perform_initialization=False` tag them here, so grad clipping,
    DDP and our converters see the same metadata either way."""
    for m in module.modules():
        dim = {ColumnParallelLinear: 0, RowParallelLinear: 1, VocabParallelEmbedding: 0}.get(type(m))
        w = getattr(m, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter) and not hasattr(w, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(w, True, dim, 1)
