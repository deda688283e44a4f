"""mmtrain: multimodal model families on megatron-core, one shared runtime (the families:
mmtrain/registry.py; how it fits together: docs/architecture.md)."""

__version__ = "0.1.0"
