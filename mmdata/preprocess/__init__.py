"""Offline preprocessing: dataset adapters, validation, seeded global shuffle, shard writing."""
