"""The decoder as a megatron-core `GPTModel` on the local layer spec, and the pieces around it
every family's model uses: token embedding of a packed batch, THD packed-sequence parameters,
the decoder run to per-token loss (over the true, unpadded vocabulary) or logits, HF-style
attention masks as packed segments, and megatron's TP tags for models built without random init.

Packed sequences run in megatron's THD layout: the [B, S] batch is flattened to one [B*S] stream
and `cu_seqlens` (one segment per packed sample / padding run) drives both RoPE (positions
restart per segment) and attention (no attention across segments), as TE/flash-attn do on GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmtrain.models.layer_specs import transformer_layer_spec
from mmtrain.models.lm_config import LLMConfig
from mmtrain.models.norm import TorchNorm


def build_language_model(
    llm: LLMConfig,
    lm_config: TransformerConfig,
    *,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    parallel_output: bool = True,
) -> GPTModel:
    """The decoder as a megatron `GPTModel` (`vocab_size`: the padded table size)."""
    block = TransformerBlockSubmodules(
        layer_specs=[transformer_layer_spec(causal=True)] * get_num_layers_to_build(lm_config, vp_stage=vp_stage),
        layer_norm=TorchNorm,
    )
    theta = llm.rope_theta
    return GPTModel(
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
    )


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int) -> PackedSeqParams:
    """THD parameters for a packed batch (self-attention: the same segments for q and kv)."""
    cu = cu_seqlens.to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        max_seqlen_q=int(max_seqlen), max_seqlen_kv=int(max_seqlen),
    )


def embed_packed(language_model: GPTModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings of a [B, S] batch as one THD stream [B*S, 1, h] (not yet scattered for
    sequence parallelism: a family may still place media features into it)."""
    return language_model.embedding(input_ids=input_ids.reshape(1, -1), position_ids=None)


def sequence_parallel_input(decoder_input: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """The decoder input as the first layer expects it: this rank's sequence slice under SP."""
    if config.sequence_parallel:
        return tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
    return decoder_input


def decoder_output(
    language_model: GPTModel,
    decoder_input: Optional[torch.Tensor],
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    true_vocab: int,
    return_logits: bool = False,
) -> torch.Tensor:
    """Run the decoder stage on a packed [B, S] batch (one THD stream).

    Last stage: the per-token loss [B, S] (0 where the label is IGNORE_INDEX) or, with
    `return_logits`, logits [B, S, true_vocab] gathered over TP. Other stages: the hidden states
    for the next one. Padded vocabulary rows would enter the softmax with logit 0, so when the
    table is padded the loss is computed over the true vocabulary only."""
    b, s = labels.shape
    post_process = language_model.post_process
    mask_pad = language_model.vocab_size > true_vocab
    mc_labels = None
    if post_process and not return_logits and not mask_pad:
        mc_labels = labels.reshape(1, -1).clamp(min=0)  # IGNORE_INDEX masked below
    out = language_model(
        input_ids=None,
        position_ids=None,
        attention_mask=None,
        decoder_input=decoder_input,
        labels=mc_labels,
        packed_seq_params=packed_seq_params(cu_seqlens, max_seqlen),
        runtime_gather_output=True if return_logits else None,
    )
    if not post_process:
        return out
    if return_logits:
        return out.reshape(b, s, -1)[..., :true_vocab]
    if mask_pad:
        out = vocab_parallel_loss(out, labels.reshape(1, -1).clamp(min=0), true_vocab)
    loss = out.reshape(b, s)
    return loss * (labels != IGNORE_INDEX).to(loss.dtype)


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
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tensor_model_parallel_attributes,
    )

    for m in module.modules():
        dim = {ColumnParallelLinear: 0, RowParallelLinear: 1, VocabParallelEmbedding: 0}.get(type(m))
        w = getattr(m, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter) and not hasattr(w, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(w, True, dim, 1)
