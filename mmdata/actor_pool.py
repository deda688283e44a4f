"""Stream work items to a fixed set of Ray actors (public Ray API only).

Why actors and not tasks: Ray (2.60) runs every task that asks for GPUs with `max_calls=1`, a
fresh worker process per task, so per-process state such as a loaded model never survives
from one task to the next. An actor keeps its state for its whole life: a model loaded in its
constructor serves every item sent to it.

`run_on_actors` keeps at most `queue_per_actor` items queued on each actor (one running, the
next already shipped, so an actor never waits on the driver), hands results over as they
complete, and survives actor deaths: an actor created with `max_restarts=R` is restarted by Ray,
the items it held are sent again (to any live actor), and after R + 1 deaths it is left out.
A failure inside an item's code, or in an actor's constructor, is raised as is: retrying a
deterministic error only repeats it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class ActorPoolError(RuntimeError):
    """Every actor is dead, or one item killed its actor more often than allowed."""


@dataclass
class ActorStats:
    """What happened to one actor slot during a run (for the job's manifest)."""

    items: int = 0  # items it finished
    deaths: int = 0  # times its process died (each followed by a Ray restart while any are left)


@dataclass
class _Slot:
    actor: Any
    in_flight: int = 0
    incarnation: int = 0  # bumped on each observed death, so the calls lost with one death count once
    stats: ActorStats = field(default_factory=ActorStats)


def run_on_actors(actors: Sequence[Any], items: Iterable[Any], call: Callable[[Any, Any], Any],
                  on_done: Callable[[Any, Any], None], *, queue_per_actor: int = 2, max_restarts: int = 2,
                  max_attempts: int = 3) -> list[ActorStats]:
    """Run `call(actor, item)` (which returns an ObjectRef, e.g. `actor.f.remote(item)`) for
    every item, `on_done(item, result)` as results arrive, in completion order. `max_restarts`
    must be the actors' own `max_restarts` option; an item is given up after `max_attempts`
    actor deaths while it ran. Returns per-actor stats, in the order of `actors`."""
    import ray
    from ray.exceptions import RayActorError

    if not actors:
        raise ValueError("run_on_actors needs at least one actor")
    if queue_per_actor < 1:
        raise ValueError(f"queue_per_actor must be at least 1, got {queue_per_actor}")
    slots = [_Slot(a) for a in actors]
    todo: deque[tuple[Any, int]] = deque()  # (item, attempts so far): retries go first
    source = iter(items)
    pending: dict[Any, tuple[_Slot, Any, int, int]] = {}  # ref -> (slot, item, attempts, incarnation)
    exhausted = False

    def next_item() -> tuple[Any, int] | None:
        nonlocal exhausted
        if todo:
            return todo.popleft()
        if not exhausted:
            for item in source:
                return item, 0
            exhausted = True
        return None

    def fill() -> None:
        for slot in slots:
            while slot.stats.deaths <= max_restarts and slot.in_flight < queue_per_actor:
                nxt = next_item()
                if nxt is None:
                    return
                item, attempts = nxt
                pending[call(slot.actor, item)] = (slot, item, attempts, slot.incarnation)
                slot.in_flight += 1

    fill()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            slot, item, attempts, incarnation = pending.pop(ref)
            slot.in_flight -= 1
            try:
                result = ray.get(ref)
            except RayActorError as e:
                if e.actor_init_failed:  # e.g. the model cannot load: the same on every restart
                    raise
                if incarnation == slot.incarnation:  # the first lost call of this death
                    slot.incarnation += 1
                    slot.stats.deaths += 1
                if attempts + 1 >= max_attempts:
                    raise ActorPoolError(f"{item!r}: its actor died {attempts + 1} times while running it "
                                         f"(last: {str(e).splitlines()[0]})") from e
                todo.append((item, attempts + 1))
                if all(s.stats.deaths > max_restarts for s in slots):
                    raise ActorPoolError(f"all {len(slots)} actors died more than {max_restarts} times each "
                                         f"(last: {str(e).splitlines()[0]})") from e
                continue
            slot.stats.items += 1
            on_done(item, result)
        fill()
    return [s.stats for s in slots]
