"""The Ray and output-folder parts under the resumable stage runner (mmdata/stage_runner.py,
which runs `mmdata preprocess` and `mmdata tokenize-images`): starting and stopping Ray, bounded
task submission, and the output folder's rules.

Output folder: a job's state lives in `DIR/.mmdata-work/` (with `work.json`: the job's
fingerprint and its description); energon's `.nv-meta/` and then `manifest.json` are published
last, so a folder with a work folder and no manifest is unfinished (mmdata/readiness.py). A rerun
of the same command resumes it; a folder holding another job's output, or files this tool did
not write, is refused with the options that differ (`--overwrite` replaces this tool's outputs).

Interrupts: Ctrl-C while Ray starts or stops is held back until it is up or down (an interrupt
inside `ray.init` leaves half-started processes and crashed the interpreter at exit); elsewhere
the runner stops the job's tasks, shuts Ray down and raises `Interrupted` (INTERRUPTED, exit
status 130).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from mmdata import shard_format as sf
from mmdata.errors import UserError, deferred_interrupt
from mmdata.units import plural

log = logging.getLogger(__name__)

INTERRUPTED = "interrupted: rerun the same command to resume"
# The object store of a private local instance, in MiB (default 256; Ray's floor is 75). Rows and
# media never pass through it (tasks read inputs and write shards themselves), so it stays small
# whatever the data size; the environment variable exists to prove that (tests/test_preprocess_scaling.py).
OBJECT_STORE_ENV = "MMDATA_OBJECT_STORE_MB"
DEFAULT_OBJECT_STORE_MB = 256
MIN_OBJECT_STORE_MB = 75


def object_store_bytes() -> int:
    """The local instance's object store size, from OBJECT_STORE_ENV (a clear error when bad)."""
    raw = os.environ.get(OBJECT_STORE_ENV, "").strip()
    if not raw:
        return DEFAULT_OBJECT_STORE_MB << 20
    if not raw.isdigit() or int(raw) < MIN_OBJECT_STORE_MB:
        raise UserError(
            f"{OBJECT_STORE_ENV}={raw!r}: give a whole number of MiB, at least {MIN_OBJECT_STORE_MB} (Ray's minimum)"
        )
    return int(raw) << 20


def init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to `address` / RAY_ADDRESS, or start a private local instance (Ctrl-C held back
    until it is up). Returns whether this process owns the instance.

    Only `ray.init`'s public options: a private instance gets `num_cpus`, no dashboard and a
    small object store (OBJECT_STORE_ENV); the driver neither streams worker logs
    (`log_to_driver=False`: they stay in Ray's session folder) nor prints Ray's info lines.
    Ray's other helper processes (log monitor, autoscaler monitor, a minimal API server) start
    as Ray decides: part of Ray's fixed start and stop (docs/preprocess.md, "Benchmark"), paid
    once per job whatever its size. A new `ray.init` cluster reports no usage statistics
    (Ray turns them off for it unless the wheel is a nightly). No `RAY_<name>` setting is
    changed: of those that might cut the driver's own Ray threads (task events, metrics, event
    stats, heartbeats) none alone moved its 1.5-2.3 ms of CPU per second beyond noise, and all
    together about 20 %, at the cost of the dashboard's task view and metrics
    (benchmarks/ray_driver_ticks.py; docs/preprocess.md, "Ray's settings")."""
    try:
        import ray  # (2 s to import; `mmdata --help` imports this module through its commands)
    except ImportError:
        raise UserError(
            "the Ray jobs (mmdata preprocess, mmdata tokenize-images) need Ray, the `data` extra: "
            "pip install 'mmdata-mmtrain[data]' (a training-only install leaves it out)"
        ) from None

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = {"log_to_driver": False, "configure_logging": True, "logging_level": "warning"}
    store = None if address else object_store_bytes()  # (a bad setting: a clear error before Ray starts)
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            with deferred_interrupt():
                if address:
                    ray.init(address=address, **kwargs)
                else:
                    with _quiet_default_token_auth():
                        ray.init(
                            address="local",
                            num_cpus=num_cpus,
                            include_dashboard=False,
                            object_store_memory=store,
                            **kwargs,
                        )
            return True
        except KeyboardInterrupt:  # held back until Ray was up: take it down again
            shutdown_ray(True)
            raise
        except Exception as err:  # Ray raises a bare Exception for it; anything else is not ours to judge
            if RAY_STARTUP_TIMEOUT not in str(err):
                raise
            ray.shutdown()  # what the failed start left, before the next try
            if attempt == RAY_START_ATTEMPTS:
                raise UserError(ray_start_timed_out_message(attempt)) from None
            log.warning("Ray's node timed out during startup (a busy machine?); starting it once more")
    raise AssertionError("unreachable")  # the loop returns or raises


#: Ray gives its raylet a fixed 30 s to register (ray/_private/node.py, no setting), which a busy
#: login node can miss; the start is tried this many times before the job gives up with one line.
RAY_START_ATTEMPTS = 2
#: the text of Ray's error for it (a bare `Exception`, so matched by its words)
RAY_STARTUP_TIMEOUT = "timed out during startup"


def ray_start_timed_out_message(attempts: int) -> str:
    load = os.getloadavg()[0]
    return (
        f"Ray's node did not start in time, {attempts} tries (Ray waits 30 s for it; load average {load:.1f} on "
        f"{os.cpu_count()} cores): rerun when the machine is less busy, or start Ray once with `ray start --head` "
        "and pass its address with --address"
    )


class _DropAuthEnabledNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_AUTH_ENABLED_NOTICE)


#: what Ray (2.5x+) logs on every start of a new local instance, whose token authentication it turns
#: on by default: a notice, not a problem, for a private instance of this job. (Ray's warning that
#: authentication is *disabled* stays: that one is a real risk.) Matched by its text, so when Ray
#: rewords it the notice shows again; nothing breaks.
RAY_AUTH_ENABLED_NOTICE = "Token authentication is enabled for this Ray cluster"


#: the logger of that notice (Ray's module logger). Only a name handed to the standard `logging`
#: module, which matches it as text: nothing of Ray's is imported or called through it, and when
#: Ray moves the module the filter simply no longer applies (the notice shows; nothing breaks).
#: tests/test_private_names.py counts imports and attribute uses of libraries' private names, not
#: this string.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"  # gated-private-api: a logger name only


@contextlib.contextmanager
def _quiet_default_token_auth() -> Iterator[None]:
    """Drop RAY_AUTH_ENABLED_NOTICE while `ray.init` starts a private instance."""
    flt, logger = _DropAuthEnabledNotice(), logging.getLogger(RAY_AUTH_LOGGER)
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def shutdown_ray(owned: bool) -> None:
    """Stop the instance this process started, or leave the cluster it joined (Ctrl-C held back
    until it is down)."""
    if owned:
        import ray  # (see init_ray)

        with deferred_interrupt():
            ray.shutdown()


def discard(out: Path, work: Path, created: bool) -> None:
    """Leave nothing behind (a job that has nothing to write): the work folder, and the output
    folder when this run created it and it is empty otherwise."""
    remove([work] + ([out] if created and not any(p != work for p in out.iterdir()) else []))


_END = object()


def run_bounded(
    submit: Callable[[Any], Any], items: Iterable[Any], max_in_flight: int, on_done: Callable[[Any, Any], None]
) -> None:
    """Submit tasks with at most `max_in_flight` pending; results handled as they complete."""
    import ray  # (see init_ray)

    pending: dict = {}

    def drain(n_left: int) -> None:
        while len(pending) > n_left:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                on_done(pending.pop(ref), ray.get(ref))

    it = iter(items)
    while True:
        drain(max_in_flight - 1)  # wait for a free slot before taking the next item
        item = next(it, _END)
        if item is _END:
            break
        pending[submit(item)] = item
    drain(0)
    # On Ctrl-C nothing is cancelled here: the tasks share their owner's fate (Ray kills them when
    # the driver shuts down or exits), and `ray.cancel(force=True)` racing a task's completion
    # crashes the driver inside Ray ("Tried to complete task that was not pending", Ray 2.60).


def remove(paths: Iterable[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def check_output_dir(
    out: Path,
    fp: str,
    job: dict,
    overwrite: bool,
    own_outputs: Callable[[Path], list[Path]],
    error: type[UserError],
    saved_job: Callable[[dict], dict | None] = lambda m: m.get("job"),
) -> dict | None:
    """Before anything is written: refuse an output that is a file, or a folder holding another
    job's result or files this tool did not write; return the manifest when this very job is
    already complete there. `--overwrite` removes this tool's outputs (other files are kept).
    `job` is what the fingerprint `fp` was computed from; `saved_job(manifest)` the manifest's."""
    if out.exists() and not out.is_dir():
        raise error(f"--output {out} is a file; give a folder (a new one, or one this tool wrote)")
    if not out.exists():
        return None
    if overwrite:
        remove(own_outputs(out))
        return None
    manifest_path, work_json = out / sf.MANIFEST_NAME, out / sf.WORK_DIR_NAME / "work.json"
    hint = "pass --overwrite to replace it, or choose another --output"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fp:
            return manifest
        raise error(
            f"{out} already holds shards made with other inputs or options "
            f"({changes_text(saved_job(manifest), job, manifest.get('fingerprint'), fp)}); {hint}"
        )
    if work_json.exists():
        state = json.loads(work_json.read_text())
        if state.get("fingerprint") != fp:
            raise error(
                f"{out} holds an unfinished job on other inputs or options "
                f"({changes_text(state.get('job'), job, state.get('fingerprint'), fp)}); {hint}"
            )
        return None
    own = set(own_outputs(out))
    if any(p.name.startswith("shard-") for p in own) or (out / sf.ENERGON_META).exists():
        raise error(f"{out} holds shards not written by a resumable mmdata job; {hint}")
    foreign = sorted(p.name for p in out.iterdir() if p not in own)
    if foreign:
        raise error(
            f"--output {out} is not empty ({plural(len(foreign), 'entry', 'entries')} this tool did not write, e.g. "
            f"{foreign[0]!r}); choose an empty or new folder, or pass --overwrite to write there anyway"
        )
    return None


def shard_outputs(out: Path) -> list[Path]:
    """The files both jobs write into `out` besides their own: manifest, quarantine, energon's
    metadata, the work folder, the shards with their indexes, and their temporary files."""
    names = [sf.MANIFEST_NAME, sf.QUARANTINE_NAME, sf.ENERGON_META, sf.WORK_DIR_NAME]
    paths = [out / n for n in names if (out / n).exists()]
    for pattern in (
        "shard-*.tar",
        "shard-*.tar.idx",
        ".shard-*.tar.tmp-*",
        "shard-*.tar.idx.tmp",
        f"{sf.ENERGON_META}.tmp-*",
    ):
        paths += sorted(out.glob(pattern))
    return paths


# ----------------------------------------------------------------------------- what changed


def changes_text(old: dict | None, new: dict, old_fp: Any, new_fp: str) -> str:
    """ "samples_per_shard 50 → 100, seed 0 → 1" (at most 3, then "and N more"); the two
    fingerprints when no option differs (or the folder's record names none)."""
    diffs = describe_changes(old, new) if isinstance(old, dict) else []
    if not diffs:
        return f"fingerprint {str(old_fp)[:12]} → {new_fp[:12]}"
    more = f", and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return "changed: " + ", ".join(diffs[:3]) + more


def describe_changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Leaf differences between two JSON-like values, as "path old → new"."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in list(old) + [k for k in new if k not in old]:
            out += describe_changes(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} → {plural(len(new), 'entry', 'entries')}"]
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            label = b.get("rel") or b.get("path") if isinstance(b, dict) else None
            out += describe_changes(a, b, f"{path}[{label or i}]")
        return out
    return [] if old == new else [f"{path} {_short(old)} → {_short(new)}"]


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."
