"""megatron-energon side: the sample type of our shards, the parts every model family shares
(batch contract, packing, savable loader state, the loader factory with blending) and one
task-encoder package per family.

Common modules (one job each):
  sample.py          energon sample type of our shards (ConversationSample) + sample_loader
                     (named by `.nv-meta/mmdata.yaml`; mmdata/energon_configs.py)
  labels.py          IGNORE_INDEX, the label that takes no loss (a torch-free leaf)
  batch.py           PackedBatch (what the training runtime reads from any batch)
  packing.py         pack selection (energon hook) and packed-row attention metadata
  loader.py          build_loader(data, task_encoder, ...) -> SavableLoader, LoaderStats, blend YAML
  state_codec.py     loader state <-> JSON (no pickles in checkpoints)
  sequence.py        one sample's token sequence (ids, unshifted targets, media spans), IGNORE_INDEX,
                     length policy
  task_encoding.py   PackingTaskEncoder (counted skips, packing + batch hooks), PackedBatch fields
  video.py           decord probing / uniform frame sampling

Per family:
  llava_ov/          anyres tiling, Qwen2 chat template + loss mask, LlavaOVTaskEncoder,
                     LlavaOVBatch, build_llava_ov_loader()
  emu3/              Emu3 serialisation, understanding / generation tasks + loss masks,
                     Emu3TaskEncoder, Emu3Batch, build_emu3_loader(), the token shards' format
                     (token_format.py) and sample type (vq_token_sample.py)


A new family adds one package here with its task encoder (a `PackingTaskEncoder`), its
`PackedBatch` subclass and a `build_<family>_loader` that hands the encoder to `loader.build_loader`.

Below this package (imported by it, never importing it): mmdata/packing/ (pack plans, vision-aware
balancing, the packing report) and mmdata/media_layout/ (the anyres and media arithmetic).
"""
