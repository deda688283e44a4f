"""Tiny random models that benchmarks and tests build (no downloads): the Qwen2 decoder and
SigLIP tower configs of the tiny LLaVA-OV, a tiny HF Emu3 over a given tokenizer and VQ, and the
small decoder config of the GPU checks."""

from __future__ import annotations

from pathlib import Path


def text_config(**kw) -> dict:
    """The tiny LLaVA-OV's Qwen2 decoder: 2 layers, hidden 64, 4 heads over 2 KV groups; `kw` overrides."""
    d = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    d.update(kw)
    return d


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
    from mmtrain.models.lm_config import LLMConfig

    shape = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, num_query_groups=2)
    return LLMConfig(**shape, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **kw)
