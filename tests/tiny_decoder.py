"""A 2-layer decoder on the project's local layer spec and a packed batch for it (tests of the
THD RoPE, tests/test_packed_rope.py and its CP worker): the same weights either with the spec's
`PackedRoPESelfAttention` or with megatron's own `SelfAttention` (its unfused THD RoPE)."""

from __future__ import annotations

import torch

HEADS, DIM, VOCAB = 3, 16, 96


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def tiny_lm(megatrons_attention: bool):
    """The decoder (CP size from megatron's parallel_state, as a run builds it); built from the
    same seeds each call, so two calls hold the same weights."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mmtrain.models.language_model import build_language_model
    from mmtrain.models.layer_specs import transformer_layer_spec
    from mmtrain.models.lm_config import LLMConfig
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config
    from mmtrain.models.packed_rope import PackedRoPESelfAttention

    llm = LLMConfig(
        num_layers=2,
        hidden_size=HEADS * DIM,
        ffn_hidden_size=64,
        num_attention_heads=HEADS,
        num_query_groups=1,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
    )
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    lm = build_language_model(llm, language_transformer_config(llm, "float32", ParallelOptions()), vocab_size=VOCAB)
    cp = parallel_state.get_context_parallel_world_size() > 1
    for layer in lm.decoder.layers:
        ours = layer.self_attention
        assert type(ours) is PackedRoPESelfAttention
        if megatrons_attention:
            spec = transformer_layer_spec(causal=True, context_parallel=cp).submodules.self_attention.submodules
            theirs = SelfAttention(
                config=ours.config, layer_number=ours.layer_number, attn_mask_type=AttnMaskType.causal, submodules=spec
            )
            theirs.load_state_dict(ours.state_dict())
            layer.self_attention = theirs
    return lm.eval()


def packed_batch(lens: list[int]):
    """One row of packed samples (the last length: a padding run), random tokens."""
    from mmdata.energon_loaders.batch import PackedBatch

    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    return PackedBatch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=torch.cat([torch.arange(n) for n in lens])[None],
        cu_seqlens=cu_seqlens(lens),
        max_seqlen=max(lens),
        sample_ids=[[str(i) for i in lens[:-1]]],
    )
