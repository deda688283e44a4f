"""mmdata: offline preprocessing of multimodal instruction data into energon-ready shards,
and the energon loaders that stream them. Imports nothing from mmtrain."""

__version__ = "0.1.0"
