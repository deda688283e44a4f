"""LLaVA-OneVision on megatron-core: model builder, forward step, HF conversion."""

from __future__ import annotations


def load_llava_ov(ckpt_dir, iteration=None):
    """See `mmtrain.llava_ov.load.load_llava_ov` (imported lazily: megatron is heavy)."""
    from mmtrain.llava_ov.load import load_llava_ov as _load

    return _load(ckpt_dir, iteration)


__all__ = ["load_llava_ov"]
