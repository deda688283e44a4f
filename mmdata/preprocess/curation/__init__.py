"""Offline curation steps of `mmdata preprocess`: perceptual-hash near-duplicate removal,
record filters and the source mix (see docs/preprocess.md, "Curation")."""
