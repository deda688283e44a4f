"""What auto_tune prints: the summary lines, the model's error against the trials (and the
calibration fitted on them), and the table of candidates."""

from __future__ import annotations

from mmdata.units import plural
from mmtrain.config import Recipe
from mmtrain.planning.calibration import Calibration, calibrated_errors, fit, rel_errors
from mmtrain.planning.candidates import FAILED, NOT_RUN, PRUNED_HISTORY, PRUNED_MEMORY, RAN, Candidate
from mmtrain.planning.cost_model import GB, Layout
from mmtrain.planning.search_space import DIMENSIONS


def layout_text(L: Layout) -> str:
    some = f" (the first {L.recompute_num_layers} layers of each stage)" if L.recompute_num_layers else ""
    pipeline = (f" x vpp {L.vpp}" if L.vpp > 1 else "") + (
        f" (decoder layers {list(L.pp_layers)})" if L.pp_layers else ""
    )
    vision = f", vision tower tp {L.vision_tp} (its own layout)" if L.vision_tp is not None else ""
    return (
        f"tp {L.tp}, pp {L.pp}{pipeline}, cp {L.cp}, dp {L.dp}, micro-batch {L.micro_batch_size}, recompute "
        f"{L.recompute}{some}, "
        f"sequence parallel {'on' if L.sequence_parallel else 'off'}, distributed optimizer "
        f"{'on' if L.distributed_optimizer else 'off'}{vision}"
    )


def fit_calibration(cands: list[Candidate], device: str, in_use: str | None) -> tuple[Calibration | None, list[str]]:
    """The model against the measured trials: its error raw, with the calibration file in use
    (if any) and refitted on these trials; and that fit."""
    ran = [c for c in cands if c.measured and c.trial.max_peak_gib is not None]
    if not ran:
        return None, []
    est_mem = [c.memory.total / GB for c in ran]
    meas_mem = [c.trial.max_peak_gib for c in ran]
    est_step = [c.step.total_s for c in ran]
    meas_step = [c.trial.step_time_s for c in ran]
    cal = fit(est_mem, meas_mem, est_step, meas_step, device)
    mem_after, step_after, loo = calibrated_errors(est_mem, meas_mem, est_step, meas_step)
    how = "leave-one-out" if loo else "in-sample, fewer than 3 trials"

    def used(est, meas) -> str:
        return f"; with auto_tune.calibration: {rel_errors(est, meas).text()}" if in_use else ""

    lines = [
        f"memory model vs measured peak (busiest rank, {plural(len(ran), 'trial')}): "
        f"{rel_errors(est_mem, meas_mem).text()}{used([c.est_mem_gib for c in ran], meas_mem)}; "
        f"refitted here ({how}): {mem_after.text()}",
        f"step-time model vs measured: {rel_errors(est_step, meas_step).text()}"
        f"{used([c.est_step_s for c in ran], meas_step)}; refitted here ({how}): {step_after.text()}",
        f"calibration: memory = {cal.memory_offset_gib:.3g} GiB + {cal.memory_scale:.3g} x model, "
        f"step time = {cal.time_scale:.3g} x model",
    ]
    return cal, lines


def summary(recipe: Recipe, cands: list[Candidate], best: Candidate | None, model_only: bool) -> list[str]:
    a, p = recipe.auto_tune, recipe.parallel
    n = len(cands)
    count = lambda s: sum(c.status == s for c in cands)  # noqa: E731
    pruned = count(PRUNED_MEMORY) + count(PRUNED_HISTORY)
    ctx_dims = ", ".join(
        f"{d.name} {sorted({getattr(c.layout, d.name) for c in cands}, key=_sort_key)}" for d in DIMENSIONS
    )
    failed = [c.trial.status for c in cands if c.status == FAILED]
    lines = [
        f"auto_tune: {n} layouts for world size {p.world_size} ({plural(p.nnodes, 'node')} x {p.nproc_per_node}): "
        f"{ctx_dims}",
        f"pruned without running: {pruned} of {n} ({pruned / max(n, 1):.0%}): memory model {count(PRUNED_MEMORY)} "
        f"(band {a.device_memory_gb * a.min_memory_fraction:.3g}..{a.device_memory_gb * a.memory_fraction:.3g} GiB), "
        f"history {count(PRUNED_HISTORY)}",
        f"trials: {count(RAN)} ran, {len(failed)} failed"
        + (
            f" ({', '.join(f'{failed.count(k)} {k}' for k in ('oom', 'timeout', 'crash') if k in failed)})"
            if failed
            else ""
        )
        + f", {sum(c.reused for c in cands)} reused from history.csv, {count(NOT_RUN)} not run",
    ]
    if model_only:
        lines.append("MODEL-BASED: auto_tune.max_trials=0, no trial runs; the pick is the cost model's")
    base = next((c for c in cands if c.baseline), None)
    if best is not None and best.measured:
        lines.append(
            f"best: {layout_text(best.layout)}: {best.trial.tokens_per_s:,.0f} tokens/s "
            f"({best.trial.step_time_s:.3g} s/step), peak {best.trial.max_peak_gib or 0:.3g} GiB/rank"
        )
        if base is not None and base.measured:
            lines.append(
                f"speedup over the recipe's own layout ({base.key}, {base.trial.tokens_per_s:,.0f} tokens/s): "
                f"{best.trial.tokens_per_s / base.trial.tokens_per_s:.2f}x"
            )
        else:
            why = f"{base.status}: {base.reason}" if base else "not in the search space"
            lines.append(f"speedup over the recipe's own layout: n/a ({why})")
    elif best is not None:
        lines.append(
            f"best (modelled): {layout_text(best.layout)}: ~{best.est_mem_gib:.3g} GiB/rank, "
            f"~{best.est_step_s:.3g} s/step"
        )
    return lines


def _sort_key(value: object) -> tuple:
    """None (a dimension's "inherit" value) first, then numbers, then text."""
    return (value is not None, isinstance(value, str), value if isinstance(value, (int, float)) else 0, str(value))


def display_order(cands: list[Candidate]) -> list[Candidate]:
    """Measured first (fastest first), then failed, then the rest by modelled time."""
    rank = {RAN: 0, FAILED: 1, NOT_RUN: 2, PRUNED_HISTORY: 3, PRUNED_MEMORY: 4}
    return sorted(cands, key=lambda c: (rank[c.status], -c.trial.tokens_per_s if c.measured else c.est_step_s))


TABLE = ["key", "status", "est GiB", "meas GiB", "est s/step", "meas s/step", "meas tok/s"]


def table(cands: list[Candidate], top: int) -> str:
    rows = []
    for c in cands[:top]:
        t = c.trial
        ran = c.status == RAN
        rows.append(
            [
                c.key + (" *" if c.baseline else ""),
                c.status,
                f"{c.est_mem_gib:.3g}",
                f"{t.max_peak_gib:.3g}" if t is not None and t.max_peak_gib is not None else "-",
                f"{c.est_step_s:.3g}",
                f"{t.step_time_s:.3g}" if ran else "-",
                f"{t.tokens_per_s:,.0f}" if ran else "-",
            ]
        )
    widths = [max(len(r[i]) for r in [TABLE, *rows]) for i in range(len(TABLE))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [TABLE, *rows]]
    return "\n".join(
        lines + ["(* the recipe's own layout; est = the model, calibrated when auto_tune.calibration is set)"]
    )
