"""`--mix FILE.yaml` or `--mix source=weight,...`: target proportions per source (or per input
subset), met by deterministic down-sampling and, when asked, up-sampling by repetition.

    by: source            # or subset (the input folder, e.g. stage2/2a); default source
    weights:              # relative; normalised to proportions
      llava: 3
      docmatix: 1
      "*": 1              # every group not listed (without "*": those are left out)
    total: 100000         # optional: the output size
    repeat: false         # allow up-sampling by repetition

Without `total` the output is as large as it can be without repeating records (`repeat:
false`: the group that is scarcest for its weight is kept whole) or without dropping any
(`repeat: true`: the most plentiful one is kept whole, the others are repeated up to their
share). With `total`, a group short of its target is repeated when `repeat` is on and
otherwise kept whole (its realised count is then below the target; both are in the manifest).

Determinism: the targets are apportioned to the groups (largest remainder) from the groups'
counts after filters and dedup, giving each group a factor f = target / available. A record of
the group is then written floor(f) times, plus once more when its mix draw u < frac(f), where u
is a blake2b hash of (seed, record identity) independent of the shuffle key: a decision per
record, the same whatever the workers, buckets or input order. So the realised counts match the
targets in expectation (within about sqrt(target) records); both are in the manifest. A repeated
record's copies get their own shuffle keys, so they land anywhere in the output, not next to
each other.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

BY = ("source", "subset")
OTHERS = "*"


class MixError(ValueError):
    """A malformed --mix (reported before the job starts)."""


@dataclass(frozen=True)
class MixSpec:
    by: str
    weights: tuple[tuple[str, float], ...]  # listed groups (OTHERS for the rest), as given
    total: int | None = None
    repeat: bool = False

    def weight(self, group: str) -> float:
        w = dict(self.weights)
        return w.get(group, w.get(OTHERS, 0.0))

    def listed(self) -> list[str]:
        """The groups named by weight (OTHERS excluded): each must exist in the input."""
        return [g for g, _ in self.weights if g != OTHERS]

    def to_json(self) -> dict:
        return {"by": self.by, "weights": dict(self.weights), "total": self.total, "repeat": self.repeat}


def _weights(obj: object, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(obj, dict) or not obj:
        raise MixError(f"{where}: `weights` must be a non-empty mapping group: weight")
    out = []
    for name, w in obj.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise MixError(f"{where}: weight of {name!r} must be a number >= 0, not {w!r}")
        out.append((str(name), float(w)))
    if not any(w > 0 for _, w in out):
        raise MixError(f"{where}: at least one weight must be > 0")
    return tuple(sorted(out))


def parse_mix(arg: str) -> MixSpec:
    """A YAML file (path ending in .yaml/.yml) or inline `group=weight,...` (by source)."""
    if arg.endswith((".yaml", ".yml")):
        path = Path(arg)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as e:
            raise MixError(f"--mix {arg}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise MixError(f"--mix {arg}: not valid YAML: {e}") from None
        if not isinstance(doc, dict):
            raise MixError(f"--mix {arg}: expected a mapping with `weights`")
        unknown = set(doc) - {"by", "weights", "total", "repeat"}
        if unknown:
            raise MixError(f"--mix {arg}: unknown key(s) {sorted(unknown)}; keys: by, weights, total, repeat")
        by = doc.get("by", "source")
        if by not in BY:
            raise MixError(f"--mix {arg}: `by` must be one of {BY}, not {by!r}")
        total = doc.get("total")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise MixError(f"--mix {arg}: `total` must be an integer >= 0")
        repeat = doc.get("repeat", False)
        if not isinstance(repeat, bool):
            raise MixError(f"--mix {arg}: `repeat` must be true or false")
        return MixSpec(by, _weights(doc.get("weights"), f"--mix {arg}"), total, repeat)
    pairs = {}
    for item in arg.split(","):
        name, eq, w = item.partition("=")
        if not eq or not name.strip():
            raise MixError(f"--mix {arg!r}: expected FILE.yaml or source=weight,... (e.g. llava=3,docmatix=1)")
        try:
            pairs[name.strip()] = float(w)
        except ValueError:
            raise MixError(f"--mix {arg!r}: weight of {name.strip()!r} is not a number") from None
    return MixSpec("source", _weights(pairs, f"--mix {arg!r}"))


def apportion(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to `weights` summing to `total` (largest remainder; ties: first)."""
    s = sum(weights)
    if total <= 0 or s <= 0:
        return [0] * len(weights)
    ideal = [total * w / s for w in weights]
    out = [math.floor(x) for x in ideal]
    for i in sorted(range(len(ideal)), key=lambda i: (-(ideal[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    return out


def group_targets(spec: MixSpec, available: dict[str, int]) -> dict[str, int]:
    """Output records per group (see the module docstring)."""
    groups = sorted(available)
    w = [spec.weight(g) for g in groups]
    live = [(g, wi) for g, wi in zip(groups, w) if wi > 0 and available[g] > 0]
    if spec.total is not None:
        total = spec.total
    elif not live:
        total = 0
    else:
        s = sum(wi for _, wi in live)
        ratios = [available[g] * s / wi for g, wi in live]  # the total at which g is exactly used up
        total = math.floor(max(ratios) if spec.repeat else min(ratios) + 1e-9)
    targets = dict(zip(groups, apportion(total, [spec.weight(g) if available[g] > 0 else 0.0 for g in groups])))
    if not spec.repeat:
        targets = {g: min(t, available[g]) for g, t in targets.items()}
    return targets


def factors(targets: dict[str, int], available: dict[str, int]) -> dict[str, float]:
    """Times each group's records are written on average (0: left out, 1: kept whole)."""
    return {g: targets[g] / available[g] if available[g] else 0.0 for g in sorted(targets)}


def copies(factor: float, seed: int, rid: str) -> int:
    """How many times one record is written: floor(f), plus one when its draw u < frac(f)."""
    whole = math.floor(factor)
    if factor == whole:
        return whole
    u = (
        int.from_bytes(
            hashlib.blake2b(rid.encode("utf-8", "surrogateescape"), digest_size=8, key=f"mix:{seed}".encode()).digest(),
            "big",
        )
        / 2**64
    )
    return whole + (u < factor - whole)
