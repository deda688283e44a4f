"""megatron-energon side: sample type, task encoders (LLaVA-OV anyres, chat template, packing),
and the loader factory used by training.

Modules (one job each):
  sample.py          energon sample type of our shards (ConversationSample) + sample_loader
  anyres.py          LLaVA-OV dynamic resolution: pixels and the shared shape/token arithmetic
  chat_template.py   Qwen2 ChatML rendering, media expansion, loss mask, over-length policy
  video.py           decord probing / uniform frame sampling
  packing.py         pack selection (energon hook) and packed-row attention metadata
  task_encoder.py    LlavaOVTaskEncoder: energon hooks -> LlavaOVBatch (batch.py)
  loader.py          build_llava_ov_loader(), LoaderStats, blend YAML helper
  state_codec.py     loader state <-> JSON (no pickles in checkpoints)
  tiny_tokenizer.py  offline Qwen2-style tokenizer for tests/demos
  tiny_emu3_tokenizer.py  offline tokenizer with Emu3's vocabulary layout (specials + visual tokens)
  emu3_serialize.py  Emu3's token stream: [bos] text [boi] "H*W" [img] rows+[eol] [eof] [eoi] (pure)
  vq_token_sample.py energon sample type of Emu3 token shards (mmdata tokenize-images) + sample_loader
  dev_shards.py      write small energon-ready shard sets from in-memory samples
"""
