"""mmtrain: LLaVA-OneVision and Emu3 training on megatron-core, one shared runtime."""

__version__ = "0.1.0"
