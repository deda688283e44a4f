"""Tiny random models that benchmarks and tests build (no downloads): the Qwen2 decoder and
SigLIP tower configs of the tiny LLaVA-OV, a tiny HF Emu3 over a given tokenizer and VQ, and the
small decoder config of the GPU checks."""

from __future__ import annotations

from pathlib import Path


def tiny_llm(layers: int, hidden: int, ffn: int, heads: int, kv_groups: int, vocab: int, positions: int, **kw):
    """An LLMConfig of the given decoder shape (the order a shape is written in the tests and
    benchmarks); `kw`: the other LLMConfig fields."""
    from mmtrain.models.lm_config import LLMConfig

    shape = dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads)
    return LLMConfig(**shape, num_query_groups=kv_groups, vocab_size=vocab, max_position_embeddings=positions, **kw)


def text_config(**kw) -> dict:
    """The tiny LLaVA-OV's Qwen2 decoder: 2 layers, hidden 64, 4 heads over 2 KV groups; `kw` overrides."""
    from mmtrain.models.state_dict_adapter import hf_decoder_keys

    llm = tiny_llm(2, 64, 128, 4, 2, vocab=1000, positions=4096)
    return dict(model_type="qwen2", **hf_decoder_keys(llm), rope_theta=llm.rope_theta) | kw


def vision_config(image_size: int = 30, patch_size: int = 14, **kw) -> dict:
    """The tiny LLaVA-OV's SigLIP tower: 2 layers, hidden 32, at 30 px in patches of 14; `kw` overrides."""
    return (
        dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=patch_size,
            vision_use_head=False,
        )
        | kw
    )


def random_hf_emu3(
    tok, vq_dir: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, max_positions: int, noise=0.0
):
    """A random Emu3ForConditionalGeneration (eval mode) over the tokenizer `tok`, with the VQ
    model of `vq_dir`; `noise` perturbs every text-model tensor (norms and all), so conversions
    cannot pass by luck and greedy outputs vary. The caller seeds torch."""
    import torch
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig, Emu3VQVAE

    vq = Emu3VQVAE.from_pretrained(vq_dir)
    text = Emu3TextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        attention_dropout=0.0,
    )
    config = Emu3Config(text_config=text, vq_config=vq.config.to_dict(), vocabulary_map=tok.get_vocab())
    model = Emu3ForConditionalGeneration(config).eval()
    model.model.vqmodel.load_state_dict(vq.state_dict())
    if noise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "vqmodel" not in name:
                    p.add_(torch.randn_like(p) * noise)
    return model


def small_llm(vocab_size: int, max_position_embeddings: int, **kw):
    """A small 2-layer decoder (hidden 256, FFN 1024, 4 heads over 2 KV groups): the LLMConfig the GPU
    checks and the vision-layout benchmark build; `kw`: other LLMConfig fields."""
    return tiny_llm(2, 256, 1024, 4, 2, vocab=vocab_size, positions=max_position_embeddings, **kw)
