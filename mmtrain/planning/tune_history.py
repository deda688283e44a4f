"""auto_tune's history.csv: every candidate of a search, and the finished trials a later search
on the same recipe (same fingerprint) reuses instead of running them again."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

from mmtrain.config import Recipe
from mmtrain.config.load import recipe_to_dict
from mmtrain.planning.candidates import FAILED, RAN, Candidate
from mmtrain.planning.cost_model import GB
from mmtrain.planning.search_space import DIMENSIONS
from mmtrain.planning.trials import TrialResult


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
