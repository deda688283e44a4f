"""LLaVA-OneVision on megatron-core: model builder, forward step, HF conversion."""
