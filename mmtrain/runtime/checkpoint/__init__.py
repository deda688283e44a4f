"""Checkpoints: directory layout (layout.py), model weights + architecture check (weights.py),
training checkpoints over stateful parts (manager.py)."""
