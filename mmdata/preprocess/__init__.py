"""`mmdata preprocess`: dataset adapters, validation, curation, seeded global shuffle and its shard
writing stages, length counting; what it shares with `mmdata tokenize-images` is in mmdata/shard_job/."""
