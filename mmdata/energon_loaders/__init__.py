"""megatron-energon side: sample type, task encoders (LLaVA-OV anyres, chat template, packing),
and the loader factory used by training."""
