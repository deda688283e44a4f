"""`action: auto_tune`: find the layout that is really fastest, by measuring it.
Design notes: docs/training.md, "auto_tune: search, prune, measure"."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from mmdata.errors import UserError
from mmtrain.config import Recipe, load_recipe_dict, save_resolved
from mmtrain.config.load import recipe_to_dict
from mmtrain.planning.calibration import Calibration
from mmtrain.planning.candidates import FAILED, NOT_RUN, PRUNED_HISTORY, PRUNED_MEMORY, RAN, Candidate
from mmtrain.planning.cost_model import (
    GB,
    Hardware,
    Layout,
    estimate_memory,
    estimate_step_time,
)
from mmtrain.planning.search_space import (
    SpaceContext,
    apply_layout,
    candidate_layouts,
    needs_more_memory,
)
from mmtrain.planning.trials import TrialResult, run_trial
from mmtrain.planning.tune_history import fingerprint, load_history, write_history
from mmtrain.planning.tune_report import display_order, fit_calibration, summary, table
from mmtrain.runtime.distributed import resolve_backend
from mmtrain.runtime.preflight import preflight
from mmtrain.spec import FamilySpec

OUT_DIR = "auto_tune"
_now = time.monotonic  # the search's clock (max_minutes); tests move it
#: (recipe for one layout, its trial run_dir, time limit in s) -> measurement; tests pass a simulator
TrialFn = Callable[[Recipe, Path, float], TrialResult]


@dataclass
class AutoTuneResult:
    candidates: list[Candidate]  # in trial order: survivors of the memory prune first
    best: Candidate | None  # the best measured layout (the model's pick with max_trials=0)
    best_recipe: Recipe | None
    recipe_path: Path | None
    csv_path: Path
    text: str
    calibration: Calibration | None = None

    @property
    def exit_code(self) -> int:
        """1 when no layout fits or none ran successfully, so a script notices."""
        return 0 if self.best is not None else 1


def trials_on_cuda(recipe: Recipe) -> bool:
    """Whether trials run on GPUs: the backend their workers will resolve (nccl: CUDA), the one
    run-device decision (runtime.distributed.resolve_backend; gloo with GPUs visible is refused)."""
    return resolve_backend(recipe.parallel.backend) == "nccl"


def evaluate(
    recipe: Recipe, spec: FamilySpec, on_cuda: bool | None = None, calibration: Calibration | None = None
) -> list[Candidate]:
    """Every candidate with its (calibrated) estimates, fastest modelled first."""
    if on_cuda is None:
        on_cuda = trials_on_cuda(recipe)
    cal = calibration or Calibration.load(recipe.auto_tune.calibration)
    shapes = spec.model_shapes(recipe.model)
    a = recipe.auto_tune
    hw = Hardware.from_auto_tune(a)
    own = Layout.from_recipe(recipe)
    out = []
    for layout in candidate_layouts(SpaceContext(recipe, shapes, on_cuda)):
        mem = estimate_memory(shapes, recipe.freeze, layout, a.media_token_fraction)
        step = estimate_step_time(shapes, recipe.freeze, layout, hw, a.media_token_fraction)
        out.append(
            Candidate(
                layout, mem, step, cal.memory_bytes(mem.total) / GB, cal.step_s(step.total_s), baseline=layout == own
            )
        )
    out.sort(key=lambda c: (c.est_step_s, c.est_mem_gib))
    return out


def prune_by_memory(cands: list[Candidate], recipe: Recipe) -> None:
    a = recipe.auto_tune
    upper, lower = a.device_memory_gb * a.memory_fraction, a.device_memory_gb * a.min_memory_fraction
    for c in cands:
        if c.est_mem_gib > upper:
            c.status, c.reason = PRUNED_MEMORY, f"estimate {c.est_mem_gib:.3g} GiB > {upper:.3g} GiB budget"
        elif c.est_mem_gib < lower and not c.baseline:  # the recipe's own layout stays: the reference
            c.status, c.reason = PRUNED_MEMORY, f"estimate {c.est_mem_gib:.3g} GiB < {lower:.3g} GiB (utilisation band)"


def trial_order(cands: list[Candidate]) -> list[Candidate]:
    """Survivors of the memory prune: the recipe's own layout first, then fastest modelled first."""
    alive = [c for c in cands if not c.status]
    return sorted(alive, key=lambda c: not c.baseline)  # stable: keeps the model's order


# ----------------------------------------------------------------------------- history pruning


def oom_dominator(c: Candidate, done: list[Candidate]) -> Candidate | None:
    """A layout that ran out of memory and needs no more memory than `c`."""
    for f in done:
        if f.trial is not None and f.trial.status == "oom" and needs_more_memory(c.layout, f.layout):
            return f
    return None


def optimistic_time_scale(done: list[Candidate]) -> float | None:
    """The smallest measured / modelled step-time ratio of the trials so far: scaled by it, the
    model gives a layout's best case, so "cannot beat the best" is not decided on an average the
    model's misranking would skew."""
    ratios = [c.trial.step_time_s / c.est_step_s for c in done if c.measured and c.trial.step_time_s]
    return min(ratios) if ratios else None


def best_measured(cands: list[Candidate]) -> Candidate | None:
    ran = [c for c in cands if c.measured and c.trial.tokens_per_s]
    return max(ran, key=lambda c: c.trial.tokens_per_s) if ran else None


# ----------------------------------------------------------------------------- the search


def search(
    recipe: Recipe,
    spec: FamilySpec,
    trial_fn: TrialFn = run_trial,
    on_cuda: bool | None = None,
    log: Callable[[str], None] = print,
) -> list[Candidate]:
    """Prune, run trials and prune by history; every candidate ends with a status."""
    a = recipe.auto_tune
    out_dir = Path(recipe.run_dir) / OUT_DIR
    cands = evaluate(recipe, spec, on_cuda)
    prune_by_memory(cands, recipe)
    order = trial_order(cands)
    fp = fingerprint(recipe)
    earlier = load_history(out_dir / "history.csv", fp)
    done: list[Candidate] = []
    for c in order:
        if c.key in earlier:
            _record(c, earlier[c.key], reused=True)
            done.append(c)
    start, trials = _now(), 0
    for c in order:
        if c.status:
            continue
        if (f := oom_dominator(c, done)) is not None:
            c.status, c.reason = PRUNED_HISTORY, f"needs at least the memory of {f.key}, which ran out of memory"
            continue
        best, scale = best_measured(done), optimistic_time_scale(done)
        if best is not None and scale is not None and not c.baseline:
            predicted = c.est_step_s * scale
            if predicted > best.trial.step_time_s * (1 + a.slow_margin):
                c.status, c.reason = (
                    PRUNED_HISTORY,
                    (
                        f"model predicts at best {predicted:.3g} s/step, > {best.trial.step_time_s:.3g} s of "
                        f"{best.key} + {a.slow_margin:.0%}"
                    ),
                )
                continue
        left_s = a.max_minutes * 60 - (_now() - start)
        if trials >= a.max_trials or left_s <= 0:
            c.status = NOT_RUN
            c.reason = (
                f"budget: auto_tune.max_trials={a.max_trials} spent"
                if trials >= a.max_trials
                else f"budget: auto_tune.max_minutes={a.max_minutes:g} spent"
            )
            continue
        trials += 1
        log(f"auto_tune: trial {trials}: {c.key} (model: {c.est_mem_gib:.3g} GiB/rank, {c.est_step_s:.3g} s/step)")
        result = trial_fn(apply_layout(recipe, c.layout), out_dir / "trials" / c.key, min(a.trial_timeout_s, left_s))
        _record(c, result)
        done.append(c)
        log(f"auto_tune:   -> {_trial_text(c)}")
    return order + [c for c in cands if c.status == PRUNED_MEMORY]


def _record(c: Candidate, result: TrialResult, reused: bool = False) -> None:
    c.trial, c.reused = result, reused
    c.status = RAN if result.ok else FAILED
    c.reason = "" if result.ok else f"{result.status}: {result.reason}"


def _trial_text(c: Candidate) -> str:
    t = c.trial
    if c.status == RAN:
        mem = f", peak {t.max_peak_gib:.3g} GiB/rank" if t.max_peak_gib is not None else ""
        return f"{t.tokens_per_s:,.0f} tokens/s ({t.step_time_s:.3g} s/step){mem}"
    return c.reason


def best_recipe(recipe: Recipe, c: Candidate) -> Recipe:
    return dataclasses.replace(apply_layout(recipe, c.layout), action="run")


def check_trials_can_start(recipe: Recipe, spec: FamilySpec) -> None:
    """The checks of `action: run` (required keys, data, tokenizer, starting checkpoint), once
    before the first trial: a missing shard folder is one message (exit 2), not N crashed trials."""
    if recipe.parallel.nnodes > 1:
        raise UserError(
            f"auto_tune trials run on this node only, but parallel.nnodes={recipe.parallel.nnodes}: "
            "tune on one node (parallel.nnodes=1) or rank with the model alone (auto_tune.max_trials=0)"
        )
    as_run = dataclasses.replace(recipe, action="run")
    load_recipe_dict(recipe_to_dict(as_run), family=recipe.family, source="the trial recipe (action: run)")
    preflight(as_run, spec)


def run_auto_tune(
    recipe: Recipe,
    spec: FamilySpec,
    out: TextIO | None = None,
    trial_fn: TrialFn = run_trial,
    on_cuda: bool | None = None,
) -> AutoTuneResult:
    """Search, print the summary, write history.csv, best.yaml and calibration.yaml."""
    stream = out or sys.stdout
    on_cuda = trials_on_cuda(recipe) if on_cuda is None else on_cuda
    emit = lambda s: print(s, file=stream, flush=True)  # noqa: E731
    if trial_fn is run_trial and recipe.auto_tune.max_trials > 0:
        check_trials_can_start(recipe, spec)
    out_dir = Path(recipe.run_dir) / OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    cands = search(recipe, spec, trial_fn, on_cuda, log=emit)
    csv_path = out_dir / "history.csv"
    write_history(csv_path, cands, fingerprint(recipe))
    model_only = recipe.auto_tune.max_trials == 0 and not any(c.trial for c in cands)
    best = best_measured(cands)
    if best is None and model_only:
        best = min((c for c in cands if c.status == NOT_RUN), key=lambda c: c.est_step_s, default=None)
    lines = [""] + summary(recipe, cands, best, model_only)
    cal, cal_lines = fit_calibration(cands, "cuda" if on_cuda else "cpu", recipe.auto_tune.calibration)
    if cal is not None:
        cal_path = cal.save(out_dir / "calibration.yaml")
        lines += cal_lines + [f"  (use it: auto_tune.calibration={cal_path})"]
    lines += ["", table(display_order(cands), recipe.auto_tune.top), ""]
    chosen, recipe_path = None, None
    if best is not None:
        chosen = best_recipe(recipe, best)
        recipe_path = save_resolved(chosen, out_dir / "best.yaml")
        lines.append(
            f"wrote {recipe_path} (train it: mmtrain {recipe.family} {recipe_path}, or rerun with --launch) "
            f"and {csv_path}"
        )
    else:
        fits = [c for c in cands if c.status != PRUNED_MEMORY]
        if not cands:
            lines.append("no valid layout for this world size and batch")
        elif not fits:
            smallest = min(cands, key=lambda c: c.est_mem_gib)
            lines.append(f"no layout fits; smallest needs {smallest.est_mem_gib:.3g} GiB/rank")
        else:
            lines.append("no layout ran successfully (see the reasons in history.csv)")
        lines.append(f"wrote {csv_path}")
    text = "\n".join(lines)
    emit(text)
    return AutoTuneResult(cands, best, chosen, recipe_path, csv_path, text, cal)
