"""Emu3 (model builder, vision tokenizer glue, CFG generation) — not implemented yet."""
