"""Shared megatron-core building blocks every model family composes (no family named here).

lm_config.py           LLMConfig: decoder sizes in HF terms (a recipe section); vocab padding
shapes.py              ModelShapes: a family's building blocks and their parameter counts
flops.py               model FLOPs per token and per step (real samples: MFU; executed: HFU)
hardware.py            dense peak TFLOP/s by exact device name (a leaf)
layout_rules.py        the CP sequence multiple, the vision tower's TP choices (a leaf)
device.py              compute_device: the run's device, read off the process group (a leaf)
megatron_config.py     ParallelOptions, TransformerConfig kwargs, the decoder's TransformerConfig
language_model.py      the decoder as a megatron GPTModel, THD packed-sequence params, LM loss
                       over the true vocabulary, TP tags for no-init builds
layer_specs.py         local pre-norm transformer layer spec, MLP submodules, core-attention pick
attention.py           SDPACoreAttention (packed THD without an S x S mask; CPU and GPU)
norm.py                TorchNorm (LayerNorm / RMSNorm that works with sequence parallelism)
state_dict_adapter.py  HF <-> megatron streaming adapters, qkv / gate-up layouts, the Llama-style
                       decoder (Llama, Qwen2), decoder HF config mappings
model_io.py            canonical tensors <-> a TP/PP-sharded model
encoder_parallel.py    a media encoder's own parallel layout: tiles split over the TP x CP ranks,
                       outputs gathered, gradients routed back (parallel.vision.tp)
hf_io.py               safetensors reading (one tensor at a time) and sharded writing
"""
