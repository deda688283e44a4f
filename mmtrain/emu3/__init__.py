"""Emu3 on megatron-core: what is Emu3 and nothing else (the decoder and every other megatron
building block come from `mmtrain.models`; the token stream from mmdata.energon_loaders.emu3).

  spec.py                the family's FamilySpec (registered in mmtrain/registry.py)
  config.py              recipe sections: model (the decoder), data (task mix, CFG dropout); checks
  model.py               Emu3Model: one pipeline stage
  state_dict_adapter.py  HF <-> megatron names for Emu3ForConditionalGeneration; HF config mapping
  conversion.py          `mmtrain convert` for emu3 (the VQ model kept alongside as HF weights)
  load.py                load_emu3 (inference), load_hf_into_model (checkpoint.load of HF)
"""
