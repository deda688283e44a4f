"""Dev tools: what the demo, the tests and the benchmarks build their inputs with. Not part of the
product: nothing outside mmdata.dev imports it (dev imports the product, never the reverse), and
its own dependencies (scikit-image for the photos) come with the `dev` extra.

  synth.py                `mmdata synth`: a small synthetic dataset in a real on-disk layout
  synth_records.py        its records (conversations, `image` fields, broken ones)
  synth_media.py          its pictures and clips
  synth_writers.py        its on-disk layouts (Infinity-MM tars, LLaVA-style JSONL + images)
  photo_source.py         photo-like pictures for synth (scikit-image's bundled photos)
  shards.py               small energon-ready shard sets straight from in-memory samples
  bpe.py                  the byte-level BPE both tiny tokenizers are trained with
  tiny_tokenizer.py       `mmdata tiny-tokenizer`: the tiny offline Qwen2-style tokenizer
  tiny_emu3_tokenizer.py  `mmdata tiny-tokenizer --family emu3`: the same with Emu3's vocabulary layout
  tiny_vq.py              `mmdata tiny-vq`: a tiny random Emu3 VQ model (built by tiny_vq_model.py)
"""
