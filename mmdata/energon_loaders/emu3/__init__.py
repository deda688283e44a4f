"""Emu3 on the energon loaders: its token serialisation (`serialize.py`), the understanding and
generation tasks (`tasks.py`), the task encoder and batch type, the loader factory training uses
(`build_emu3_loader`), and the tiny Emu3-layout tokenizer for tests and demos."""
