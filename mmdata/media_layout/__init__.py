"""How the loaders lay a sample's media out, as arithmetic on sizes (no torch, numpy or PIL): the
LLaVA-OneVision anyres geometry (anyres_math.py) and a record's media tokens and vision tiles from
the validator's header sizes (media.py). The loaders, the length index (preprocess/lengths.py),
pack planning (packing/) and the training side's model layout all count with this one copy, so
they can never disagree; it imports nothing of the project.
"""
