"""The shared base of the two Ray jobs (`mmdata preprocess`, `mmdata tokenize-images`), both run by
mmdata/stage_runner.py: what they read and write besides their own records.

  manifest.py      the manifest's counts (`Counts`), `fingerprint`, `write_json_atomic`
  progress.py      live progress on stderr (`JobProgress`)
  shard_writer.py  one deterministic WebDataset shard, with its layout (direct_io.py: how the bytes go out)
  tar_scan.py      list a tar's members by its headers
  energon_meta.py  `.nv-meta/` and the `.tar.idx` files from the writers' layouts
                   (energon_sample_loader.py: the self-contained sample loader copied into `.nv-meta/`)
  quarantine.py    quarantine lines and their concatenation
  lengths.py       the length index's file name, its vision-tiles column, the tokenizer fingerprint

Nothing here imports either job (mmdata.preprocess, mmdata.vision_tokens).
"""
