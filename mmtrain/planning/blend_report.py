"""The planned data mixture of a `data.sharding: global` recipe, for `action: dry_run`: the share
of each source at a few steps of the run (mmdata.global_order.blend.Blend.shares_at), so a
schedule can be read before it trains. Each step's planned shares (its rows' units) go to metrics.jsonl."""

from __future__ import annotations

from mmdata.global_order.blend import Blend
from mmtrain.config.global_order_checks import source_names
from mmtrain.config.schema import Recipe

#: fractions of the run whose shares are printed (each schedule point inside the run as well)
RUN_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def report_steps(blend: Blend, iters: int) -> list[int]:
    """The steps to show: a few spread over the run and every schedule point inside it."""
    last = max(iters - 1, 0)
    steps = {round(f * last) for f in RUN_FRACTIONS} | {p.step for p in blend.points if p.step <= last}
    return sorted(steps)


def blend_lines(recipe: Recipe) -> list[str]:
    """`planned data shares (...)` and one line per shown step; [] for another sharding or a plan."""
    if recipe.data.sharding != "global" or recipe.data.packing == "plan" or not recipe.data.paths:
        return []  # (a packing plan's rows are one folder's, no blend)
    names = source_names(recipe.data.paths)
    blend = Blend.parse(recipe.data.blend, names)
    lines = [
        f"planned data shares over the run (data.sharding: global; blend unit {blend.unit}, ramp {blend.ramp}; "
        f"schedule steps count the steps trained before, so step s is metrics.jsonl's step s+1, where each "
        "step's planned shares are):"
    ]
    return lines + [f"  {line}" for line in blend.describe(report_steps(blend, recipe.train.iters))]
