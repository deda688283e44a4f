"""LLaVA-OneVision on the energon loaders: anyres tiling, the Qwen2 chat template, its task
encoder and batch type, and the loader factory training uses (`build_llava_ov_loader`)."""
