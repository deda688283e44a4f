"""Training FLOPs for MFU: 3x (forward + backward) the matmul FLOPs.

Per LLM token: 2 * (dense matmul params) forward, plus causal attention 2 * 2 * s/2 * h per
layer; times 3 for training. The vision tower is counted per tile (`vision_flops_per_tile`):
callers add it for the tiles of a step when they know them.
"""

from __future__ import annotations

from mmtrain.llava_ov.config import LlavaOVModelConfig


def llm_matmul_params(cfg: LlavaOVModelConfig) -> int:
    m = cfg.llm
    hn = m.kv_channels
    attn = m.hidden_size * (m.num_attention_heads * hn + 2 * m.num_query_groups * hn) + m.num_attention_heads * hn * m.hidden_size
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    return m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size


def flops_per_token(cfg: LlavaOVModelConfig, seq_length: int) -> float:
    m = cfg.llm
    dense = 2 * llm_matmul_params(cfg)
    attn = m.num_layers * 2 * 2 * (seq_length / 2) * m.num_attention_heads * m.kv_channels
    return 3.0 * (dense + attn)


def vision_flops_per_tile(cfg: LlavaOVModelConfig, trainable: bool = True) -> float:
    v = cfg.vision
    n = v.num_patches
    per_layer = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.ffn_hidden_size
    fwd = 2 * n * (v.num_layers * per_layer + 3 * v.patch_size**2 * v.hidden_size) + v.num_layers * 4 * n * n * v.hidden_size
    proj = 2 * n * (v.hidden_size * cfg.llm.hidden_size + cfg.llm.hidden_size**2)
    return (3.0 if trainable else 1.0) * (fwd + proj)
