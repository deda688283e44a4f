"""The label convention every loader and the training loss share, in a torch-free leaf: the
text side (chat templates, sequences) and mmtrain's family specs import it at CLI start-up,
while the batch classes (mmdata/energon_loaders/batch.py) import torch."""

from __future__ import annotations

#: label value that takes no loss (transformers' and megatron's convention)
IGNORE_INDEX = -100
