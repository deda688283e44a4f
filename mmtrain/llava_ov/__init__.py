"""LLaVA-OneVision on megatron-core: what is LLaVA-OV and nothing else (the decoder and every
other megatron building block come from `mmtrain.models`).

  spec.py                the family's FamilySpec (registered in mmtrain/registry.py)
  config.py              recipe sections: model (LLM + SigLIP + projector), data; cross-checks
  vision.py              SigLIP tower
  projector.py           mlp2x_gelu projector
  layout.py              anyres feature layout (unpad, shrink, newlines, video pooling)
  model.py               LlavaOVModel: one pipeline stage
  forward_step.py        megatron forward step
  hf_inputs.py           HF processor tensors -> LlavaOVBatch
  state_dict_adapter.py  HF <-> megatron names for LLaVA-OV and SigLIP; HF config mapping
  conversion.py          `mmtrain convert` for llava-ov (whole checkpoints, stage-1 assembly)
  load.py                load_llava_ov (inference), load_hf_into_model (checkpoint.load of HF)
"""
