"""`action: auto_tune`: find the layout that is really fastest, by measuring it.
Design notes: docs/training.md, "auto_tune: search, prune, measure"."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from mmdata.errors import UserError
from mmdata.units import plural
from mmtrain.config import Recipe, load_recipe_dict, save_resolved
from mmtrain.config.load import recipe_to_dict
from mmtrain.planning.calibration import Calibration, calibrated_errors, fit, rel_errors
from mmtrain.planning.cost_model import (
    GB,
    Hardware,
    Layout,
    MemoryEstimate,
    StepTime,
    estimate_memory,
    estimate_step_time,
)
from mmtrain.planning.search_space import (
    DIMENSIONS,
    SpaceContext,
    apply_layout,
    candidate_layouts,
    layout_key,
    needs_more_memory,
)
from mmtrain.planning.trials import TrialResult, run_trial
from mmtrain.runtime.distributed import resolve_backend
from mmtrain.runtime.preflight import preflight
from mmtrain.spec import FamilySpec

OUT_DIR = "auto_tune"
PRUNED_MEMORY, PRUNED_HISTORY, RAN, FAILED, NOT_RUN = "pruned_memory", "pruned_history", "ran", "failed", "not_run"
_now = time.monotonic  # the search's clock (max_minutes); tests move it
#: (recipe for one layout, its trial run_dir, time limit in s) -> measurement; tests pass a simulator
TrialFn = Callable[[Recipe, Path, float], TrialResult]


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate  # the analytical model, uncalibrated
    step: StepTime
    est_mem_gib: float  # calibrated: what pruning and ordering use
    est_step_s: float
    status: str = ""
    reason: str = ""
    trial: TrialResult | None = None
    reused: bool = False
    baseline: bool = False  # the recipe's own layout

    @property
    def key(self) -> str:
        return layout_key(self.layout)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch_size * self.layout.seq_length

    @property
    def est_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.est_step_s

    @property
    def measured(self) -> bool:
        return self.status == RAN and self.trial is not None


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


# ----------------------------------------------------------------------------- reuse


def fingerprint(recipe: Recipe) -> str:
    """What makes two trials comparable: the recipe without its tuned keys, run_dir, launch
    address and search settings (trial length kept)."""
    d = recipe_to_dict(recipe)
    for key in ("run_dir", "action", "auto_tune"):
        d.pop(key, None)
    for dim in DIMENSIONS:
        *sections, name = dim.recipe_key.split(".")
        node = d
        for section in sections:
            node = node.get(section, {})
        node.pop(name, None)
    for name in ("master_port", "master_addr", "node_rank"):
        d.get("parallel", {}).pop(name, None)
    d.get("train", {}).pop("iters", None)
    d["trial"] = [recipe.auto_tune.trial_steps, recipe.auto_tune.warmup_steps]
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_history(path: Path, fp: str) -> dict[str, TrialResult]:
    """Finished trials (ran or failed) of an earlier search on the same recipe, by layout key."""
    if not path.exists():
        return {}
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("fingerprint") != fp or row.get("status") not in (RAN, FAILED):
                continue
            mem = [float(x) for x in row.get("meas_mem_gib_by_rank", "").split(";") if x]
            if row["status"] == RAN:
                out[row["key"]] = TrialResult(
                    RAN,
                    "",
                    float(row["meas_tokens_per_s"]),
                    float(row["meas_step_s"]),
                    mem,
                    float(row.get("trial_wall_s") or 0),
                )
            else:
                kind, _, why = row.get("reason", "").partition(": ")
                out[row["key"]] = TrialResult(
                    kind if kind in ("oom", "timeout", "crash") else "crash",
                    why,
                    peak_mem_gib=mem,
                    wall_s=float(row.get("trial_wall_s") or 0),
                )
    return out


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


# ----------------------------------------------------------------------------- outputs


HISTORY_COLUMNS = [
    "key",
    "status",
    "reason",
    "baseline",
    "reused",
    *[d.name for d in DIMENSIONS],
    "dp",
    "est_mem_gib",
    "meas_mem_gib",
    "meas_mem_gib_by_rank",
    "model_mem_gib",
    "est_step_s",
    "meas_step_s",
    "model_step_s",
    "est_tokens_per_s",
    "meas_tokens_per_s",
    "trial_wall_s",
    "fingerprint",
]


def write_history(path: Path, cands: list[Candidate], fp: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, HISTORY_COLUMNS)
        w.writeheader()
        for c in cands:
            t = c.trial
            row = {
                "key": c.key,
                "status": c.status,
                "reason": c.reason,
                "baseline": c.baseline,
                "reused": c.reused,
                **{d.name: getattr(c.layout, d.name) for d in DIMENSIONS},
                "dp": c.layout.dp,
                "est_mem_gib": round(c.est_mem_gib, 4),
                "model_mem_gib": round(c.memory.total / GB, 4),
                "est_step_s": round(c.est_step_s, 5),
                "model_step_s": round(c.step.total_s, 6),
                "est_tokens_per_s": round(c.est_tokens_per_s, 1),
                "fingerprint": fp,
            }
            if t is not None:
                row.update(
                    meas_mem_gib="" if t.max_peak_gib is None else round(t.max_peak_gib, 4),
                    meas_mem_gib_by_rank=";".join(f"{m:.4f}" for m in t.peak_mem_gib),
                    trial_wall_s=round(t.wall_s, 1),
                )
                if c.status == RAN:
                    row.update(meas_step_s=round(t.step_time_s, 5), meas_tokens_per_s=round(t.tokens_per_s, 1))
            w.writerow(row)
    tmp.replace(path)


def best_recipe(recipe: Recipe, c: Candidate) -> Recipe:
    return dataclasses.replace(apply_layout(recipe, c.layout), action="run")


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
