"""Data mixtures of a global order: the share of each source, constant or following a schedule
over steps (stepwise or linear), counted in samples or in tokens (the length index's), and the
positional draw that realises them.

The draw is a smooth weighted round robin with credits: the next sample comes from the source
with the most credit (plus its share; ties to the lowest source number), which is then charged its
unit (1, or the sample's tokens) while every source earns its share of that unit. Credits are part
of the order's state, so the draw is the same at any layout and resumes exactly, across a
schedule boundary too; over any long span the realised shares follow the targets within a few
samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mmdata.errors import UserError

Ramp = Literal["step", "linear"]
Unit = Literal["samples", "tokens"]
RAMPS = ("step", "linear")
UNITS = ("samples", "tokens")


class BlendError(UserError):
    """A blend that cannot be followed; one line naming the entry and the fix."""


@dataclass(frozen=True)
class BlendPoint:
    """The weights (every source named, 0 where left out) from `step` on."""

    step: int
    weights: dict[str, float]


@dataclass(frozen=True)
class Blend:
    """Target shares per source over steps (see the module docstring)."""

    points: tuple[BlendPoint, ...]
    ramp: Ramp = "step"
    unit: Unit = "samples"
    names: tuple[str, ...] = field(default=())

    @classmethod
    def parse(cls, doc: dict | None, source_names: list[str] | tuple[str, ...]) -> Blend:
        """`None` (equal weights), `{weights: {a: 3, b: 1}}` or `{schedule: [{step: 0, weights: {..}},
        ...], ramp: step|linear, unit: samples|tokens}`; anything else raises BlendError."""
        names = tuple(source_names)
        if doc is None:
            return cls((BlendPoint(0, {n: 1.0 for n in names}),), names=names)
        if not isinstance(doc, dict):
            raise BlendError(f"data.blend must be a mapping (weights: or schedule:), got {type(doc).__name__}")
        unknown = sorted(set(doc) - {"weights", "schedule", "ramp", "unit"})
        if unknown:
            raise BlendError(f"data.blend has unknown key {unknown[0]!r}: use weights, schedule, ramp, unit")
        ramp, unit = doc.get("ramp", "step"), doc.get("unit", "samples")
        if ramp not in RAMPS:
            raise BlendError(f"data.blend.ramp {ramp!r} is unknown: use one of {', '.join(RAMPS)}")
        if unit not in UNITS:
            raise BlendError(f"data.blend.unit {unit!r} is unknown: use one of {', '.join(UNITS)}")
        if ("weights" in doc) == ("schedule" in doc):
            raise BlendError("data.blend needs exactly one of weights: {source: w} or schedule: [{step:, weights:}]")
        if "weights" in doc:  # the plain form: its entries are named from data.blend (data.blend.weights)
            points: tuple[BlendPoint, ...] = (_point("data.blend", {"step": 0, "weights": doc["weights"]}, names),)
        else:
            raw = doc["schedule"]
            if not isinstance(raw, list) or not raw:
                raise BlendError("data.blend.schedule must be a non-empty list of {step: S, weights: {source: w}}")
            points = tuple(_point(f"data.blend.schedule[{i}]", p, names) for i, p in enumerate(raw))
        if points[0].step != 0:
            raise BlendError(f"data.blend.schedule[0] starts at step {points[0].step}: the first entry must be step 0")
        for i in range(1, len(points)):
            if points[i].step <= points[i - 1].step:
                raise BlendError(
                    f"data.blend.schedule[{i}] step {points[i].step} is not after step {points[i - 1].step}: "
                    "list the steps strictly increasing"
                )
        return cls(points, ramp, unit, names)

    def to_doc(self) -> dict[str, Any]:
        """The blend as `parse` reads it back (every point's weights named in full): a checkpoint
        records the blend its window was planned with."""
        schedule = [{"step": p.step, "weights": dict(p.weights)} for p in self.points]
        return {"schedule": schedule, "ramp": self.ramp, "unit": self.unit}

    def _shares(self, i: int) -> np.ndarray:
        w = np.asarray([self.points[i].weights[n] for n in self.names], dtype=np.float64)
        return w / w.sum()

    def shares_at(self, step: int) -> np.ndarray:
        """The target shares (normalised, in source order) at `step`: a linear ramp interpolates
        between the points around it; constant after the last point."""
        steps = [p.step for p in self.points]
        i = int(np.searchsorted(steps, step, side="right")) - 1
        i = max(i, 0)
        here = self._shares(i)
        if self.ramp == "step" or i + 1 >= len(self.points):
            return here
        a, b = steps[i], steps[i + 1]
        f = (step - a) / (b - a)
        return (1.0 - f) * here + f * self._shares(i + 1)

    def describe(self, steps: list[int]) -> list[str]:
        """One line per step: the planned shares there (dry runs, `mmdata inspect`)."""
        return [
            f"step {s}: " + ", ".join(f"{n} {100 * v:.1f}%" for n, v in zip(self.names, self.shares_at(s)))
            for s in steps
        ]


def _point(where: str, p: Any, names: tuple[str, ...]) -> BlendPoint:
    """One schedule entry, checked; `where` names it in the errors."""
    if not isinstance(p, dict) or set(p) - {"step", "weights"} or "weights" not in p:
        raise BlendError(f"{where} must be {{step: S, weights: {{source: w}}}}, got {p!r:.80}")
    if "step" not in p:
        raise BlendError(f"{where} has no step: give every schedule entry its step, {{step: S, weights: {{..}}}}")
    step = p["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BlendError(f"{where}.step must be a whole number >= 0, got {step!r}")
    weights = p["weights"]
    if not isinstance(weights, dict) or not weights:
        raise BlendError(f"{where}.weights must be a non-empty mapping {{source: weight}}")
    for name, w in weights.items():
        if name not in names:
            raise BlendError(f"{where}.weights names unknown source {name!r}: the sources are {', '.join(names)}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise BlendError(f"{where}.weights[{name!r}] = {w!r}: a weight must be a finite number >= 0")
    if not any(float(w) > 0 for w in weights.values()):
        raise BlendError(f"{where}.weights are all zero: give at least one source a positive weight")
    return BlendPoint(step, {n: float(weights.get(n, 0.0)) for n in names})


class Draw:
    """The blend's draw over a run: which source gives the next sample (see the module docstring)."""

    def __init__(self, credits: list[float], shares: np.ndarray) -> None:
        self.credits = [float(c) for c in credits]
        self.set_shares(shares)

    def set_shares(self, shares: np.ndarray) -> None:
        self.shares = [float(x) for x in shares]
        self._live = [s for s, x in enumerate(self.shares) if x > 0]

    def choose(self) -> int:
        """The next sample's source (not yet charged)."""
        best, top = self._live[0], -math.inf
        for s in self._live:
            v = self.credits[s] + self.shares[s]
            if v > top:
                best, top = s, v
        return best

    def charge(self, chosen: int, unit: float) -> None:
        c, sh = self.credits, self.shares
        for s in range(len(c)):
            c[s] += sh[s] * unit
        c[chosen] -= unit
