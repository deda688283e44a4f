"""The error policy of both console scripts (`mmdata` and `mmtrain`), implemented once.

- An expected problem (a bad argument, a missing path, a folder that belongs to another job, a
  recipe that does not validate) is a `UserError`: one line `PROG: error: what, where, how to fix`
  on stderr, no traceback, exit status 2. Nothing is written before it is raised.
- Ctrl-C (SIGINT) ends a command with status 130 and one line; a resumable job raises
  `Interrupted` after shutting its workers down, so the line says how to resume.
- Anything else is a bug or an environment failure: one line naming it and a log file that holds
  the traceback (`--verbose` prints the traceback instead), exit status 1.

`run_main` applies it around a parsed command; `add_common_options` gives every parser
`--verbose` (also accepted after the subcommand) and `--version`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator

from mmdata.versions import version_report

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An expected problem the user can fix; its message is one line saying what, where and how."""

    exit_code = EXIT_USAGE


class Interrupted(UserError):
    """The user interrupted a job that was shut down cleanly (exit 130)."""

    exit_code = EXIT_INTERRUPTED


class HintingParser(argparse.ArgumentParser):
    """argparse with a hint for overrides written the torchrun / accelerate way (`--train.iters=2`),
    and the same policy for usage errors: one line, exit 2."""

    def add_subparsers(self, **kwargs):  # type: ignore[override]
        """As argparse's; the action is kept so that a typo can be matched against every sub-command's flags."""
        action = super().add_subparsers(**kwargs)
        self.__dict__.setdefault("subcommand_actions", []).append(action)
        return action

    def error(self, message: str) -> None:  # type: ignore[override]
        dotted = re.findall(r"--([A-Za-z_]\w*(?:\.\w+)+)(=\S*)?", message)
        if dotted:
            key, value = dotted[0]
            message += f" (recipe overrides are written without dashes: {key}{value or '=VALUE'})"
        elif message.startswith("unrecognized arguments:"):
            message += _did_you_mean(message, self)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every `--flag` of `parser` (read from its help) and of its sub-commands, at any depth."""
    out = set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", parser.format_help()))
    for sub in getattr(parser, "subcommand_actions", []):
        for child in sub.choices.values():
            out |= _option_strings(child)
    return out


def _did_you_mean(message: str, parser: argparse.ArgumentParser) -> str:
    """ " (did you mean --overwrite?)" for the first unrecognised `--flag` close to a known one."""
    known = sorted(_option_strings(parser))
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def add_common_options(parser: argparse.ArgumentParser, version: str | None = None) -> None:
    """`--verbose` (tracebacks on stderr) on every parser; `--version` on the top-level one.
    The sub-parsers' default is SUPPRESS so `mmdata --verbose preprocess ...` is not undone."""
    top = version is not None
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="print the traceback of an unexpected error (default: written to a log file)",
    )
    if top:
        parser.add_argument(
            "--version",
            action=_VersionAction,
            version=version,
            help="print the version, the git revision and the versions of torch, megatron-core, "
            "energon, ray and transformers, and exit",
        )


class _VersionAction(argparse.Action):
    """`--version`: mmdata/versions.py's report (built only when asked: it reads package metadata)."""

    def __init__(self, option_strings, version: str, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002 - argparse's keyword
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_report(parser.prog, self.version))  # stdout, as argparse's own version action
        parser.exit(0)


def run_main(prog: str, args: argparse.Namespace, command: Callable[[argparse.Namespace], int | None]) -> int:
    """Run one parsed command under the policy above; returns the exit status."""
    try:
        return int(command(args) or 0)
    except UserError as err:
        print(str(err) if isinstance(err, Interrupted) else f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the policy's last resort: report, keep the traceback
        return _report_crash(prog, err, verbose=bool(getattr(args, "verbose", False)))


def _report_crash(prog: str, err: BaseException, verbose: bool) -> int:
    trace = "".join(traceback.format_exception(err))
    if verbose:
        sys.stderr.write(trace)
        print(f"{prog}: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    fd, path = tempfile.mkstemp(prefix=f"{prog.replace(' ', '-')}-error-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(f"{' '.join(sys.argv)}\n\n{trace}")
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    print(
        f"{prog}: internal error: {type(err).__name__}{': ' + first if first else ''} "
        f"(traceback in {path}; rerun with --verbose to print it)",
        file=sys.stderr,
    )
    return 1


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold back SIGINT while the block runs (starting or stopping Ray, publishing a result):
    an interrupt there leaves half-made processes or files. It is raised as KeyboardInterrupt
    when the block ends. Does nothing outside the main thread (signals go to the main thread)
    or when SIGINT is ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # (a process that ignores SIGINT, e.g. started in the background, keeps ignoring it)
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


class InterruptsAfterCompletion:
    """A command whose output is complete must not turn into exit 130 because Ctrl-C arrived while
    it was being put in place (a rename, removing the replaced folder, releasing a lock) or while
    the command was saying so. Around the command's writing block (`with guard:`), `guard.hold()`
    at the moment the output is complete turns later SIGINTs into a note, printed when the block
    ends: `PROG: interrupt received after WHAT was complete; nothing was lost`. A Ctrl-C before
    `hold()` stops the command as usual. Main thread only (signals go there); elsewhere, or when
    SIGINT is ignored, it does nothing."""

    def __init__(self, prog: str, what: str) -> None:
        self.prog, self.what = prog, what
        self.received = 0
        self._previous: object = None
        self._holding = False

    def __enter__(self) -> "InterruptsAfterCompletion":
        return self

    def hold(self) -> None:
        """From now on a SIGINT is counted, not raised."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        ):
            return
        self._previous = signal.signal(signal.SIGINT, self._count)
        self._holding = True

    def _count(self, signum: int, frame: object) -> None:
        self.received += 1

    def __exit__(self, *exc: object) -> None:
        if self._holding:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._holding = False
        if self.received and exc[0] is None:
            print(f"{self.prog}: interrupt received after {self.what} was complete; nothing was lost", file=sys.stderr)
