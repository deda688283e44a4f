"""What the resumable Ray jobs (`mmdata preprocess`, `mmdata tokenize-images`) share: starting
and stopping Ray, bounded task submission, and the output folder's rules.

Output folder: a job's state lives in `DIR/.mmdata-work/` (with `work.json`: the job's
fingerprint and its description); energon's `.nv-meta/` and then `manifest.json` are published
last, so a folder with a work folder and no manifest is unfinished (mmdata/readiness.py). A rerun
of the same command resumes it; a folder holding another job's output, or files this tool did
not write, is refused with the options that differ (`--overwrite` replaces this tool's outputs).

Interrupts: Ctrl-C while Ray starts or stops is held back until it is up or down (an interrupt
inside `ray.init` leaves half-started processes and crashed the interpreter at exit); elsewhere
the job stops its tasks, shuts Ray down and raises `Interrupted` ("rerun the same command to
resume", exit status 130).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from mmdata import shard_format as sf
from mmdata.errors import Interrupted, UserError, deferred_interrupt
from mmdata.units import plural

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
        raise UserError(f"{OBJECT_STORE_ENV}={raw!r}: give a whole number of MiB, at least {MIN_OBJECT_STORE_MB} "
                        "(Ray's minimum)")
    return int(raw) << 20


def init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to `address` / RAY_ADDRESS, or start a private local instance (Ctrl-C held back
    until it is up). Returns whether this process owns the instance."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(log_to_driver=False, configure_logging=True, logging_level="warning")
    store = None if address else object_store_bytes()
    try:
        with deferred_interrupt():
            if address:
                ray.init(address=address, **kwargs)
            else:
                with _lean_private_start(), _quiet_default_token_auth():
                    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=store,
                             **kwargs)
    except KeyboardInterrupt:  # held back until Ray was up: take it down again
        shutdown_ray(True)
        raise
    return True


class _DropAuthEnabledNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_AUTH_ENABLED_NOTICE)


#: what Ray (2.5x+) logs on every start of a new local instance, whose token authentication it turns
#: on by default: a notice, not a problem, for a private instance of this job. (Ray's warning that
#: authentication is *disabled* stays: that one is a real risk.) Matched by its text, so when Ray
#: rewords it the notice shows again; nothing breaks.
RAY_AUTH_ENABLED_NOTICE = "Token authentication is enabled for this Ray cluster"


#: the logger of that notice (Ray's module logger)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _quiet_default_token_auth() -> Iterator[None]:
    """Drop RAY_AUTH_ENABLED_NOTICE while `ray.init` starts a private instance."""
    flt, logger = _DropAuthEnabledNotice(), logging.getLogger(RAY_AUTH_LOGGER)
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@contextlib.contextmanager
def _lean_private_start() -> Iterator[None]:
    """While `ray.init` starts a private instance: no log monitor, no autoscaler monitor, no API
    server, and no one-second wait for the raylet. The first three are Python processes importing
    much of Ray, started on the cores the job is scanning on, for nothing a private job uses:
    - the log monitor: its drivers pass log_to_driver=False (worker logs stay in the session
      folder either way);
    - the autoscaler monitor: a one-node instance has nothing to autoscale;
    - the API server (`dashboard.py`): with include_dashboard=False it loads only the usage-stats
      module, which reports to Ray's servers unless the user opted out, and a job makes no
      network calls. `ray.init` also waits for it to come up.
    Together about 1.7 CPU-seconds, measured per process on 2 cores. `ray start` takes the first
    two (`--include-log-monitor=False`, `--no-monitor`), `ray.init` none, so the two settings are
    put on the node it builds (`RayParams.include_log_monitor`, `.no_monitor`) and the API
    server's start is skipped on that node only (its webui_url stays None, as for a node
    without one). The wait: see `_prompt_get_node`. When Ray's private modules are not there,
    Ray starts as it always does."""
    try:
        from ray._private import node as ray_node
        from ray._private import services as ray_services

        original_init, original_api = ray_node.Node.__init__, ray_node.Node.start_api_server
        original_get_node = ray_services.get_node
    except (ImportError, AttributeError):
        yield
        return

    @functools.wraps(original_init)
    def lean_init(self, ray_params, *args, **kwargs):
        if kwargs.get("head", args[0] if args else False):
            ray_params.include_log_monitor = False
            ray_params.no_monitor = True
            self._mmdata_lean = True
        original_init(self, ray_params, *args, **kwargs)

    @functools.wraps(original_api)
    def lean_api_server(self, *args, **kwargs):
        if not getattr(self, "_mmdata_lean", False):
            original_api(self, *args, **kwargs)

    ray_node.Node.__init__, ray_node.Node.start_api_server = lean_init, lean_api_server
    ray_services.get_node = _prompt_get_node(original_get_node)
    try:
        yield
    finally:
        ray_node.Node.__init__, ray_node.Node.start_api_server = original_init, original_api
        ray_services.get_node = original_get_node


_NODE_POLL_S = 0.05  # each ask is an RPC the GCS answers while it and the raylet start on the same cores
_NODE_WAIT_S = 30.0  # Ray's own raylet_start_wait_time_s


def _prompt_get_node(original: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """Ray's `services.get_node`, which `ray.init` calls until the new raylet has registered
    with the GCS, goes through the GCS accessor's GetNode, which retries once a second; the
    raylet registers a fraction of a second after the first ask, so the start waited up to a
    second with nothing to do (Ray alone: 1.9 s -> 1.4 s; 4.0 s -> 1.9 s with the driver
    scanning on 2 cores). This asks the GCS for that node every 50 ms first, then calls Ray's
    own function, which then finds it at once. Any problem with the polling leaves it to Ray's."""

    @functools.wraps(original)
    def get_node(gcs_address: str, node_id: str):
        try:
            from ray._raylet import GcsClient, NodeID
            from ray.core.generated.gcs_pb2 import GcsNodeInfo
            from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

            client = GcsClient(address=gcs_address)
            selector = GetAllNodeInfoRequest.NodeSelector(node_id=NodeID.from_hex(node_id).binary())
            deadline = time.monotonic() + _NODE_WAIT_S
            while time.monotonic() < deadline and not client.get_all_node_info(
                    timeout=5, node_selectors=[selector], state_filter=GcsNodeInfo.GcsNodeState.ALIVE):
                time.sleep(_NODE_POLL_S)
        except Exception:  # noqa: BLE001 - best effort: Ray's own wait follows
            pass
        return original(gcs_address, node_id)

    return get_node


def shutdown_ray(owned: bool) -> None:
    """Stop the instance this process started (Ctrl-C held back until it is down)."""
    if owned:
        import ray

        with deferred_interrupt():
            _stop_autoscaler_monitor(ray)
            ray.shutdown()


def _stop_autoscaler_monitor(ray) -> None:
    """`ray.shutdown` stops the raylet and the GCS first; the autoscaler monitor, stopped after
    them, tries to report its SIGTERM to the GCS that is gone and is killed only after a one-second
    timeout (Ray 2.60: shutdown 1.1 s, 0.35 s without it). A private single-node instance has
    nothing to autoscale, so its monitor is killed first. Ray's node handle is not public API:
    when it is missing or fails, the plain shutdown runs as before. (An instance started through
    `_lean_private_start` has no monitor; this covers the Ray versions where that did not apply.)"""
    try:
        ray._private.worker._global_node.kill_monitor(check_alive=False)
    except Exception:  # noqa: BLE001 - best effort, see above
        pass


def resumable(job: Callable[..., Any]) -> Callable[..., Any]:
    """A job function whose Ctrl-C (after its own clean-up: `finally` blocks shut Ray down)
    becomes `Interrupted`: "rerun the same command to resume", exit status 130."""

    @functools.wraps(job)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return job(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted(INTERRUPTED) from None

    return run


def discard(out: Path, work: Path, created: bool) -> None:
    """Leave nothing behind (a job that has nothing to write): the work folder, and the output
    folder when this run created it and it is empty otherwise."""
    remove([work] + ([out] if created and not any(p != work for p in out.iterdir()) else []))


_END = object()


def run_bounded(submit: Callable[[Any], Any], items: Iterable[Any], max_in_flight: int,
                on_done: Callable[[Any, Any], None]) -> None:
    """Submit tasks with at most `max_in_flight` pending; results handled as they complete."""
    import ray

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


def check_output_dir(out: Path, fp: str, job: dict, overwrite: bool, own_outputs: Callable[[Path], list[Path]],
                     error: type[UserError], saved_job: Callable[[dict], dict | None] = lambda m: m.get("job")) -> dict | None:
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
        raise error(f"{out} already holds shards made with other inputs or options "
                    f"({changes_text(saved_job(manifest), job, manifest.get('fingerprint'), fp)}); {hint}")
    if work_json.exists():
        state = json.loads(work_json.read_text())
        if state.get("fingerprint") != fp:
            raise error(f"{out} holds an unfinished job on other inputs or options "
                        f"({changes_text(state.get('job'), job, state.get('fingerprint'), fp)}); {hint}")
        return None
    own = set(own_outputs(out))
    if any(p.name.startswith("shard-") for p in own) or (out / sf.ENERGON_META).exists():
        raise error(f"{out} holds shards not written by a resumable mmdata job; {hint}")
    foreign = sorted(p.name for p in out.iterdir() if p not in own)
    if foreign:
        raise error(f"--output {out} is not empty ({plural(len(foreign), 'entry', 'entries')} this tool did not write, e.g. "
                    f"{foreign[0]!r}); choose an empty or new folder, or pass --overwrite to write there anyway")
    return None


def shard_outputs(out: Path) -> list[Path]:
    """The files both jobs write into `out` besides their own: manifest, quarantine, energon's
    metadata, the work folder, the shards with their indexes, and their temporary files."""
    names = [sf.MANIFEST_NAME, sf.QUARANTINE_NAME, sf.ENERGON_META, sf.WORK_DIR_NAME]
    paths = [out / n for n in names if (out / n).exists()]
    for pattern in ("shard-*.tar", "shard-*.tar.idx", ".shard-*.tar.tmp-*", "shard-*.tar.idx.tmp",
                    f"{sf.ENERGON_META}.tmp-*"):
        paths += sorted(out.glob(pattern))
    return paths


# ----------------------------------------------------------------------------- what changed


def changes_text(old: dict | None, new: dict, old_fp: Any, new_fp: str) -> str:
    """"samples_per_shard 50 → 100, seed 0 → 1" (at most 3, then "and N more"); the two
    fingerprints when the old job's description is unknown (written by an older version)."""
    if not isinstance(old, dict):
        return f"fingerprint {str(old_fp)[:12]} → {new_fp[:12]}"
    diffs = describe_changes(old, new)
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
            return [f"{path}: {len(old)} → {len(new)} entries"]
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            label = b.get("rel") or b.get("path") if isinstance(b, dict) else None
            out += describe_changes(a, b, f"{path}[{label or i}]")
        return out
    return [] if old == new else [f"{path} {_short(old)} → {_short(new)}"]


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."
