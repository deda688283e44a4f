"""What `mmdata --version` / `mmtrain --version` print: this package's version and git revision,
and the versions of the libraries whose behaviour the results depend on, so a bug report or a
run's log says exactly what ran. Read from package metadata (nothing is imported) and, in a git
checkout, from `git` (local, no network)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

#: the distributions named in the report, in order
LIBRARIES = ("torch", "megatron-core", "megatron-energon", "ray", "transformers", "webdataset")
REPO = Path(__file__).resolve().parents[1]


def git_revision(repo: Path = REPO) -> str:
    """ "<short sha>" (", modified" when tracked files differ), or why there is none."""
    if not (repo / ".git").exists():
        return "not a git checkout"
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    if sha.returncode != 0:
        return "unknown (git rev-parse failed)"
    return sha.stdout.strip() + (", modified" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def version_report(prog: str, version: str) -> str:
    """First line `PROG VERSION`, then the revision, Python and the libraries, one per line."""
    lines = [f"{prog} {version}", f"  git revision: {git_revision()}", f"  python: {sys.version.split()[0]}"]
    lines += [f"  {name}: {v}" for name, v in library_versions().items()]
    return "\n".join(lines)
