"""Emu3 vision tokenization: preprocessed shards -> shards of VQ token grids (`mmdata tokenize-images`).

Modules (one job each; the token shard contract is mmdata/energon_loaders/emu3/token_format.py):
  vq.py            Emu3ImageProcessor + Emu3VQVAE: load (safetensors only), fingerprint, encode
  stages.py        the job's two Ray stages: tokenize a chunk of samples, write a token shard
  job.py           the job's stages for the stage runner (mmdata/stage_runner.py): plan chunks,
                   energon index, manifest, quarantine
  lengths.py       the length index of token shards (--tokenizer), for Emu3 packing plans
  defaults.py      the job's defaults, which `--help` shows without importing the job
  cli.py           `mmdata tokenize-images`
"""
