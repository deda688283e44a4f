"""One writer per output folder: a training's `run_dir`, a preprocess `--output`, an export's `--dst`.

Two jobs writing one folder corrupt it silently (interleaved `metrics.jsonl` steps, shards of one
job renamed over the other's, a staging folder that vanishes under the other job). So the job
that writes a folder first takes `FolderLock(folder, what)`: an exclusive `flock` on the hidden
file `.<name>.lock` next to the folder, which records who holds it (pid, host, start time,
command). A second job gets a `UserError` naming the holder (exit 2, before it writes anything).

The lock file sits next to the folder, not inside it, so that (a) the lock exists before the
folder does and nothing is created inside a folder a refused job never writes, (b) a folder can be
replaced whole (`fresh_folder`) while its lock stays put, and (c) the folder's own content checks
(foreign files, "is it empty") never see it. The holder removes it when done.

A holder that died (crash, `kill -9`) loses its `flock` with its process; the next job takes the
lock over and says whose it was. A record naming another host is not taken over: that holder may
still run (on a file system whose locks are local to each client it would not show), so the
message says which file to delete once that job is known to be gone.

`fresh_folder(dst, overwrite, what)` is how an export fills a folder: it writes into a new sibling
folder and puts it in place at the end (with --overwrite, exchanged atomically with the old one),
so a failure midway leaves the old folder as it was and no old file survives next to new ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmdata.errors import UserError
from mmdata.units import plural

log = logging.getLogger(__name__)

#: the locks this process holds, by lock file: taking one again (auto-tune, then the training it
#: launches, in one process) is a no-op
_HELD: dict[str, "FolderLock"] = {}
#: what `flock` fails with where the file system has no locks
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _forget_in_child() -> None:
    """A forked child (loader worker, scanner, checkpoint writer) shares its parent's lock file
    description, and with it the lock: one that outlived a killed parent would keep the folder
    locked. Children close their copies; the parent alone holds the lock."""
    for held in _HELD.values():
        if held._fd is not None:
            with contextlib.suppress(OSError):
                os.close(held._fd)
            held._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def lock_path(folder: str | os.PathLike) -> Path:
    """Where the lock of `folder` lives: `.<name>.lock` in its parent (symlinks resolved)."""
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


def holds(folder: str | os.PathLike) -> bool:
    """Whether this process holds the lock of `folder` (its child processes may rely on it)."""
    held = _HELD.get(str(lock_path(folder)))
    return held is not None and held.pid == os.getpid()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe_holder(record: dict[str, Any] | None) -> str:
    """ "pid 123 on node7 since 2026-12-03 07:50:01 UTC (mmtrain llava-ov r.yaml)"."""
    if record is None:
        return "another process (which has not written its record yet)"
    command = f" ({record['command']})" if record.get("command") else ""
    return f"pid {record.get('pid')} on {record.get('host')} since {record.get('started')}{command}"


class FolderLock:
    """Exclusive, non-blocking: `with FolderLock(run_dir, "run_dir"): ...` either holds the
    folder for the block or raises `UserError` (exit 2) naming the job that holds it."""

    def __init__(self, folder: str | os.PathLike, what: str):
        self.folder = Path(folder).resolve()
        self.what = what
        self.path = lock_path(self.folder)
        self.pid = os.getpid()
        self._fd: int | None = None
        self._created: list[Path] = []
        self._nested = False

    def __enter__(self) -> "FolderLock":
        if holds(self.folder):
            self._nested = True
            return self
        self._created = _make_parents(self.path.parent)
        try:
            self._fd = self._acquire()
        except BaseException:
            _remove_empty(self._created)
            raise
        _HELD[str(self.path)] = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._nested:
            return
        _HELD.pop(str(self.path), None)
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # while still locked: a job that opened it meanwhile retries
            os.close(self._fd)
            self._fd = None
        _remove_empty(self._created)

    def _acquire(self) -> int:
        """Lock the file at `self.path`, retrying when the file it opened was removed or replaced
        meanwhile (its holder was just releasing it)."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except PermissionError:
                raise UserError(
                    f"{self.what} {self.folder}: cannot create its lock file {self.path} "
                    f"(no write permission in {self.path.parent})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(self.path)
                os.close(fd)
                raise UserError(self._busy_message(record)) from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise
                # a file system without flock (e.g. Lustre mounted without `flock`): run, unguarded
                print(
                    f"{self.what} {self.folder}: warning: this file system cannot lock {self.path} "
                    f"({os.strerror(e.errno)}); a second job writing there would not be stopped",
                    file=sys.stderr,
                )
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            try:
                self._take_over(_read_record(self.path))
                self._write_record(fd)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def _busy_message(self, record: dict[str, Any] | None) -> str:
        gone = ""
        if (
            record is not None
            and record.get("host") == socket.gethostname()
            and isinstance(record.get("pid"), int)
            and not _pid_alive(record["pid"])
        ):
            gone = " (that process has ended, but a process it started still holds the lock: stop it first)"
        return (
            f"{self.what} {self.folder} is in use by another job: {describe_holder(record)}{gone}; "
            f"wait for it to finish, or choose another {self.what}"
        )

    def _take_over(self, record: dict[str, Any] | None) -> None:
        """A record left by a holder that no longer holds the lock: said, or refused when that
        holder ran on another host (see the module's docstring)."""
        if record is None:
            return
        host, pid = record.get("host"), record.get("pid")
        if host != socket.gethostname():
            raise UserError(
                f"{self.what} {self.folder} was locked by {describe_holder(record)}, on another host, "
                f"which this host cannot check; if that job has ended, delete {self.path} and rerun"
            )
        why = (
            "no longer running"
            if not (isinstance(pid, int) and _pid_alive(pid))
            else "it no longer holds the lock; that pid is now another process"
        )
        print(f"{self.what} {self.folder}: taking over the lock of pid {pid} on {host} ({why})", file=sys.stderr)

    def _write_record(self, fd: int) -> None:
        record = {
            "pid": self.pid,
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": _command_line(),
            "what": self.what,
            "folder": str(self.folder),
        }
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def _command_line() -> str:
    """This process's command, shortened: `mmtrain llava-ov r.yaml`, `python -m mmdata.preprocess.cli ...`."""
    argv = list(sys.argv) or [""]
    head = Path(argv[0])
    if head.suffix == ".py":  # `python -m pkg.mod`: name the module
        parts = [head.stem]
        while (head.parent / "__init__.py").is_file():
            head = head.parent
            parts.insert(0, head.name)
        argv[0] = "python -m " + ".".join(parts)
    else:
        argv[0] = head.name
    text = " ".join(argv)
    return text if len(text) <= 200 else text[:197] + "..."


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, deepest first (removed again when left empty)."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:  # deepest first
        try:
            p.rmdir()
        except OSError:
            return


# ----------------------------------------------------------------------------- replacing a folder


def is_non_empty(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


@contextlib.contextmanager
def fresh_folder(dst: str | os.PathLike, overwrite: bool, what: str = "--dst") -> Iterator[Path]:
    """Yield a new, empty sibling folder to write into; on success it becomes `dst`. A non-empty
    `dst` is refused unless `overwrite`, and then replaced whole (old files never stay next to new
    ones). On failure the sibling is removed and `dst` is untouched. Call it holding `dst`'s lock:
    leftovers of an earlier, killed run are cleaned up (or, if it died between two renames,
    its old folder put back)."""
    dst = Path(dst).resolve()
    _recover(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{what} {dst} is a file; give a folder")
    if is_non_empty(dst) and not overwrite:
        entries = sorted(p.name for p in dst.iterdir())
        raise UserError(
            f"{what} {dst} is not empty ({plural(len(entries), 'entry', 'entries')}, e.g. {entries[0]!r}); choose an "
            f"empty "
            f"or new folder, or pass --overwrite to replace it"
        )
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()  # (the umask applies, as to a folder the job would have made itself)
    try:
        yield tmp
        _publish(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _recover(dst: Path) -> None:
    """What a killed `fresh_folder` left: its new folder (dropped) and, when it died between
    moving the old folder aside and the new one in, the old folder (put back)."""
    for p in sorted(dst.parent.glob(f".{dst.name}.old-*")):
        if not dst.exists():
            p.rename(dst)
            print(f"{dst}: restored the folder an interrupted replacement had moved to {p.name}", file=sys.stderr)
        else:
            shutil.rmtree(p, ignore_errors=True)
    for p in dst.parent.glob(f".{dst.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, dst: Path) -> None:
    """`tmp` becomes `dst`: a rename over a missing or empty `dst`; otherwise an atomic exchange
    (Linux renameat2), or, where the file system has none, two renames."""
    try:
        os.replace(tmp, dst)  # dst missing, or an empty folder
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(tmp, dst):
        shutil.rmtree(tmp)  # now the old folder
        return
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where that is unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))
