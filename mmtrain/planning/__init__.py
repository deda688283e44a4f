"""Planning before (or instead of) training: arithmetic on the recipe, and measured trials.

cost_model.py    per-rank memory and step time from a family's ModelShapes (models/shapes.py)
                 and its FLOPs (models/flops.py)
dry_run.py       `action: dry_run`: what a recipe would train and whether it fits
search_space.py  the auto-tune dimensions as data, and the layouts megatron accepts
trials.py        one auto-tune trial: a short run of the real job, measured
calibration.py   the cost model fitted to measured trials (a per-machine file)
auto_tune.py     `action: auto_tune`: prune with the model, run trials, prune by history
candidates.py    one auto-tune candidate: a layout, its estimates, status and trial
tune_history.py  history.csv: written by every search, finished trials reused by the next
tune_report.py   the search's summary lines, the model's error and calibration, the table
"""
