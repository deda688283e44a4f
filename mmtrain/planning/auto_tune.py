"""`action: auto_tune`: a model-based search over (tp, pp, cp, micro_batch_size, recompute).

For the recipe's world size (`parallel.nproc_per_node * parallel.nnodes`), every layout that
megatron accepts (tp within a node and dividing the attention heads / KV groups, pp dividing
the layers, cp splitting the sequence into 2*cp chunks, the global batch divisible by micro x
dp) is scored with the analytical memory and
step-time model of mmtrain/planning/cost_model.py against `auto_tune.device_memory_gb *
auto_tune.memory_fraction`. Layouts that fit are ranked by modelled step time (compute incl.
recompute, 1F1B pipeline bubble, TP all-reduces, DP gradient reduction). Sequence parallelism
is switched on whenever tp > 1 (it only saves memory); precision and the distributed optimizer
stay as the recipe says.

Unlike FlagScale's tuner, nothing is launched: no trial runs, no measured times. The output
says so; confirm the winner with a short real run (`train.iters=5`). Outputs, in run_dir:
`auto_tune.csv` (every candidate) and `auto_tune.yaml` (the recipe with the best layout,
`action: run`).
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mmdata.units import plural
from mmtrain.planning.cost_model import (
    GB,
    sequence_split_multiple,
    Hardware,
    Layout,
    MemoryEstimate,
    ModelShapes,
    StepTime,
    estimate_memory,
    estimate_step_time,
)
from mmtrain.config import Recipe, save_resolved
from mmtrain.config.schema import RECOMPUTE_MODES
from mmtrain.spec import FamilySpec


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: StepTime
    fits: bool

    def tokens_per_s_per_device(self) -> float:
        L = self.layout
        return L.global_batch_size * L.seq_length / self.step.total_s / L.world

    def mfu(self, device_tflops: float) -> float:
        return self.step.mfu(self.layout.world, device_tflops)


@dataclass
class AutoTuneResult:
    candidates: list[Candidate]  # ranked: fitting by step time, then the rest by memory
    best: Candidate | None
    best_recipe: Recipe | None
    recipe_path: Path | None
    csv_path: Path
    text: str

    @property
    def exit_code(self) -> int:
        """`mmtrain ... action=auto_tune` exits 1 when no layout fits."""
        return 0 if self.best is not None else 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_ok(shapes: ModelShapes, tp: int) -> bool:
    d, v = shapes.decoder, shapes.encoder
    ok = d.heads % tp == 0 and d.kv_groups % tp == 0 and d.ffn % tp == 0
    return ok and (v is None or (v.heads % tp == 0 and v.ffn % tp == 0))


def search_space(recipe: Recipe, shapes: ModelShapes) -> list[Layout]:
    p, t, a = recipe.parallel, recipe.train, recipe.auto_tune
    world = p.world_size
    base = Layout.from_recipe(recipe)
    tps = a.tp or _divisors(p.nproc_per_node)  # TP stays inside a node
    pps = a.pp or _divisors(shapes.decoder.layers)
    layouts = []
    for tp in tps:
        if not tp_ok(shapes, tp):
            continue
        for pp in pps:
            if world % (tp * pp) or shapes.decoder.layers % pp:
                continue
            for cp in a.cp or _divisors(world // (tp * pp)):
                if world % (tp * pp * cp) or t.seq_length % sequence_split_multiple(cp, tp, tp > 1):
                    continue
                dp = world // (tp * pp * cp)
                if t.global_batch_size % dp:
                    continue
                per_dp = t.global_batch_size // dp
                for mbs in a.micro_batch_size or [m for m in _divisors(per_dp) if m <= 64]:
                    if per_dp % mbs:
                        continue
                    for rc in a.recompute or RECOMPUTE_MODES:
                        layouts.append(base.with_(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch_size=mbs, recompute=rc,
                                                  sequence_parallel=tp > 1))
    return layouts


def evaluate(recipe: Recipe, spec: FamilySpec) -> list[Candidate]:
    shapes = spec.model_shapes(recipe.model)
    a = recipe.auto_tune
    hw = Hardware.from_auto_tune(a)
    budget = a.device_memory_gb * GB * a.memory_fraction
    out = []
    for layout in search_space(recipe, shapes):
        mem = estimate_memory(shapes, recipe.freeze, layout, a.media_token_fraction)
        step = estimate_step_time(shapes, recipe.freeze, layout, hw, a.media_token_fraction)
        out.append(Candidate(layout, mem, step, mem.total <= budget))
    out.sort(key=lambda c: (not c.fits, c.step.total_s if c.fits else c.memory.total, c.memory.total))
    return out


def best_recipe(recipe: Recipe, c: Candidate) -> Recipe:
    L = c.layout
    parallel = dataclasses.replace(recipe.parallel, tp=L.tp, pp=L.pp, cp=L.cp, recompute=L.recompute,
                                   sequence_parallel=L.sequence_parallel)
    train = dataclasses.replace(recipe.train, micro_batch_size=L.micro_batch_size)
    return dataclasses.replace(recipe, action="run", parallel=parallel, train=train)


def _row(rank: int, c: Candidate, tflops: float) -> list[str]:
    L, s = c.layout, c.step
    return [str(rank), str(L.tp), str(L.pp), str(L.cp), str(L.dp), str(L.micro_batch_size), L.recompute,
            f"{c.memory.total / GB:.1f}", f"{s.total_s:.2f}", f"{c.tokens_per_s_per_device():,.0f}",
            f"{c.mfu(tflops):.0%}", "yes" if c.fits else "no"]


HEADER = ["rank", "tp", "pp", "cp", "dp", "mbs", "recompute", "mem_gib", "step_s", "tok/s/dev", "mfu", "fits"]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [HEADER, *rows])


def run_auto_tune(recipe: Recipe, spec: FamilySpec, out: TextIO | None = None) -> AutoTuneResult:
    """Rank layouts, print the table, write auto_tune.csv and (if any fits) auto_tune.yaml."""
    stream = out or sys.stdout
    a, p = recipe.auto_tune, recipe.parallel
    cands = evaluate(recipe, spec)
    run_dir = Path(recipe.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    csv_path = run_dir / "auto_tune.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER[:7] + ["sequence_parallel", "mem_gib", "step_s", "tokens_per_s_per_device", "mfu", "fits"])
        for i, c in enumerate(cands, 1):
            L = c.layout
            w.writerow([i, L.tp, L.pp, L.cp, L.dp, L.micro_batch_size, L.recompute, L.sequence_parallel,
                        round(c.memory.total / GB, 3), round(c.step.total_s, 4),
                        round(c.tokens_per_s_per_device(), 1), round(c.mfu(a.device_tflops), 4), c.fits])
    fitting = [c for c in cands if c.fits]
    lines = [
        f"auto_tune: {len(cands)} layouts for world size {p.world_size} "
        f"({plural(p.nnodes, 'node')} x {p.nproc_per_node}), {len(fitting)} fit in "
        f"{a.device_memory_gb:g} GiB x {a.memory_fraction:g}; {a.device_tflops:g} TFLOP/s peak at "
        f"{a.matmul_efficiency:.0%} efficiency",
        "MODEL-BASED SEARCH: memory and step times are analytical estimates (mmtrain/planning/cost_model.py), "
        "no trial runs were made. Confirm the winner with a short run (train.iters=5).",
        "",
        format_table([_row(i, c, a.device_tflops) for i, c in enumerate(cands[: a.top], 1)]),
        "",
    ]
    best = fitting[0] if fitting else None
    chosen, recipe_path = None, None
    if best is not None:
        chosen = best_recipe(recipe, best)
        recipe_path = save_resolved(chosen, run_dir / "auto_tune.yaml")
        L = best.layout
        lines.append(f"best: tp {L.tp}, pp {L.pp}, cp {L.cp}, dp {L.dp}, micro-batch {L.micro_batch_size}, recompute "
                     f"{L.recompute}, sequence parallel {'on' if L.sequence_parallel else 'off'}: "
                     f"~{best.memory.total / GB:.1f} GiB/rank, ~{best.step.total_s:.2f} s/step")
        lines.append(f"wrote {recipe_path} (run it: mmtrain {recipe.family} {recipe_path}) and {csv_path}")
    else:
        lines.append(f"no layout fits; smallest needs {cands[0].memory.total / GB:.1f} GiB/rank" if cands
                     else "no valid layout for this world size and batch")
        lines.append(f"wrote {csv_path}")
    text = "\n".join(lines)
    print(text, file=stream)
    return AutoTuneResult(cands, best, chosen, recipe_path, csv_path, text)
