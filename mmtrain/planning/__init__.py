"""Planning before (or instead of) training, from arithmetic on the recipe alone.

  cost_model.py  parameter counts, per-rank memory and step time from a family's ModelShapes;
                 FLOPs per token (MFU); the device peak table
  dry_run.py     `action: dry_run`: what a recipe would train and whether it fits
  auto_tune.py   `action: auto_tune`: model-based search over (tp, pp, micro-batch, recompute)
"""
