"""Offline pack planning: a deterministic global packing plan from a shard folder's length
index, which the loader follows exactly (`data.packing: plan`; energon_loaders/plan_packing.py).

  geometry.py   what a plan's sample lengths were counted with (`PlanGeometry`), checked by training
  knapsack.py   largest-first knapsack: the row selection the online packer and the plan share
  balance.py    vision-aware balancing: rows over DP ranks and micro-batches by cost (plan and train loop)
  report.py     the packing report: bin fill and executed-token efficiency
  algorithm.py  the plan: seeded windows of the knapsack with carry-over (`plan_packing`, `PackPlan`;
                `windowed_knapsack`, which the global order's planner shares)
  plan_file.py  the plan file (`pack-plan-<N>.parquet`): its format, writing and reading
  inputs.py     the planned samples' lengths and tiles from an image shard folder's length index
  emu3.py       the same for Emu3 token shards (each sample's task and caption drop drawn)
  emu3_geometry.py  what an Emu3 plan's lengths depend on, the token length index's columns, the variant draw
  cli.py        `mmdata pack-plan DIR --seq-length N ...` and `make_plan(PlanRequest)`, which
                `mmtrain pack-plan RECIPE` calls with the recipe's values

Used by the loaders (energon_loaders/), `mmdata inspect` and the training side; it reads the
length index that `mmdata preprocess` / `mmdata tokenize-images` write. It sits below the loaders
and the jobs and imports none of them (tests/test_layers.py).
"""
