"""Emu3 on the energon loaders: its token serialisation (`serialize.py`), the understanding and
generation tasks (`tasks.py`), the task encoder and batch type, the loader factory training uses
(`build_emu3_loader`), and what it reads of `mmdata tokenize-images` output: the token shards'
on-disk contract (`token_format.py`, which that job writes to) and their energon sample type
(`vq_token_sample.py`)."""
