"""Decoder (language-model) sizes in HF terms, shared by every family whose LLM is a
Qwen2/Llama-style decoder (GQA, optional qkv bias, RMSNorm, SwiGLU, RoPE).

Plain dataclasses with no megatron import: they are recipe sections (`model.llm:`), read by the
recipe validator, the cost model and the CLI before any model is built. `megatron_config.py`
turns them into megatron `TransformerConfig`s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LLMConfig:
    """A Qwen2 / Qwen2.5 (or Llama: `qkv_bias: false`) decoder."""

    num_layers: int = 28
    hidden_size: int = 1536
    ffn_hidden_size: int = 8960
    num_attention_heads: int = 12
    num_query_groups: int = 2
    vocab_size: int = 151936  # true (HF) vocabulary size; padded in the model, see padded_vocab_size
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron pads the embedding table so every TP rank holds an equal, aligned slice:
    up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
