"""Stream work items to a fixed set of Ray actors (public Ray API only).

Why actors and not tasks: Ray (2.60) runs every task that asks for GPUs with `max_calls=1`, a
fresh worker process per task, so per-process state such as a loaded model never survives
from one task to the next. An actor keeps its state for its whole life: a model loaded in its
constructor serves every item sent to it.

`run_on_actors` keeps at most `queue_per_actor` items queued on each actor (one running, the
next already shipped, so an actor never waits on the driver) and hands results over as they
complete. Restarts are Ray's: create the actors with `max_restarts` and `max_task_retries`
(at-least-once calls, so items must be idempotent), and Ray reruns the constructor after a
crash and resends the calls that were lost with the process, including those sent while it
restarts. When an actor is beyond its restarts, its items go to the other actors. A failure
inside an item's code, or in an actor's constructor, is raised as is: retrying a deterministic
error only repeats it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError


class ActorPoolError(RuntimeError):
    """Every actor is gone, or one item was lost with more actors than allowed."""


def run_on_actors(
    actors: Sequence[Any],
    items: Iterable[Any],
    call: Callable[[Any, Any], Any],
    on_done: Callable[[Any, Any], None],
    *,
    queue_per_actor: int = 2,
    max_actors_per_item: int = 2,
) -> list[int]:
    """Run `call(actor, item)` (which returns an ObjectRef, e.g. `actor.f.remote(item)`) for
    every item, `on_done(item, result)` as results arrive, in completion order. An item whose
    actor is lost (beyond Ray's restarts) is sent to another live actor, at most
    `max_actors_per_item` actors in all. Returns the items each actor finished, in the order
    of `actors`."""
    if not actors:
        raise ValueError("run_on_actors needs at least one actor")
    if queue_per_actor < 1:
        raise ValueError(f"queue_per_actor must be at least 1, got {queue_per_actor}")
    n = len(actors)
    in_flight, finished, lost = [0] * n, [0] * n, [False] * n
    retry: deque[tuple[Any, int]] = deque()  # (item, actors lost with it so far): sent first
    source = iter(items)
    pending: dict[Any, tuple[int, Any, int]] = {}  # ref -> (actor index, item, actors lost so far)

    def next_item() -> tuple[Any, int] | None:
        if retry:
            return retry.popleft()
        for item in source:
            return item, 0
        return None

    def fill() -> None:
        for i, actor in enumerate(actors):
            while not lost[i] and in_flight[i] < queue_per_actor:
                nxt = next_item()
                if nxt is None:
                    return
                pending[call(actor, nxt[0])] = (i, *nxt)
                in_flight[i] += 1

    fill()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            i, item, tries = pending.pop(ref)
            in_flight[i] -= 1
            try:
                result = ray.get(ref)
            except RayActorError as e:
                if e.actor_init_failed:  # e.g. the model cannot load: the same on every actor
                    raise
                lost[i] = True
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                if tries + 1 >= max_actors_per_item:
                    raise ActorPoolError(
                        f"{item!r}: lost with {tries + 1} actors, each beyond its restarts (last: {first})"
                    ) from e
                if all(lost):
                    raise ActorPoolError(f"all {n} actors were lost beyond their restarts (last: {first})") from e
                retry.append((item, tries + 1))
                continue
            finished[i] += 1
            on_done(item, result)
        fill()
    return finished
