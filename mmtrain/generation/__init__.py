"""The generation engine every model family uses (`mmtrain generate FAMILY`).

  decoder.py     CachedDecoder: a megatron GPTModel with a static KV cache (prefill, then one
                 token per row per step; per-row positions; finished rows dropped)
  engine.py      generate(): batches of requests, classifier-free guidance rows in the same
                 forward, per-request logits processors, seeded sampling, stop conditions
  sampling.py    guidance mixing on log-probs, greedy / temperature / top-k / top-p
  checkpoint.py  which checkpoint was given (megatron at any TP/PP, run dir, HF), family check,
                 device / dtype, user errors

The shared command sits above the registry, outside this package (the families build on the
engine, and the registry on the families): mmtrain/generate_cli.py (parser and help, built from
the registry) and mmtrain/generate_command.py (checks, the family's job, the engine, progress).

A family plugs in through `FamilySpec.generation` (mmtrain/spec.py: `GenerationSpec`): its
options, and `prepare` returning a `GenerationJob` (its model as a `GenerationModel`, its
requests, and how results become outputs). See docs/generation.md.
"""
