"""Download the wheels a GPU node needs beside its own torch, for an install without a package index.

A GPU node usually has Python, a CUDA build of torch, transformers and pytest, and often no package
index. `pip install --no-index --find-links WHEELS -e ".[gpu]"` there needs every other distribution the
project declares (pyproject `dependencies` and the `gpu` extra: pytest-timeout), and their
dependencies, as wheels for the node's Python. This script collects them:

- the closure is read from the installed distributions of the environment that runs it (`make
  wheelhouse` runs it in the project's venv): exactly the versions CI tests, no resolver guesses;
- setuptools and wheel (pyproject's build-system) for pip's isolated build of the project;
- torch, transformers and pytest and everything they pull (nvidia-*, triton, numpy, tokenizers, ...)
  are left out: the node has them, and its torch must never be replaced;
- the `data` extra (Ray, av, decord, scikit-image: the offline preprocessing job) is left out unless
  `--with-data`; Transformer Engine is never included (it compiles against the node's torch:
  docs/gpu.md);
- one `pip download --no-deps --only-binary=:all:` per target Python (default cp311 and cp312,
  manylinux x86_64) into one folder (pure-Python wheels are shared).

It prints the wheels and the folder's size per target. Needs the package index (CI has it).

    python scripts/wheelhouse.py [--out wheelhouse] [--python 3.11,3.12] [--with-data]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
#: what a GPU node brings (and what must not be swapped): these and their whole closure stay out
NODE_HAS = ("torch", "transformers", "pytest", "pip")
#: manylinux tags a node with glibc >= 2.28 takes (older tags are compatible with newer glibc)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str  # exact, or "" with `spec`
    spec: str = ""

    def requirement(self) -> str:
        return f"{self.name}=={self.version}" if self.version else f"{self.name}{self.spec}"


def project_requirements(with_data: bool) -> list[Requirement]:
    """pyproject's runtime dependencies, the `gpu` extra (the tier's pytest-timeout) and with
    `with_data` the `data` extra,
    read from the file (the installed metadata may be an older checkout's)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    extras = project.get("optional-dependencies", {})
    if with_data:
        reqs += [Requirement(r) for r in extras.get("data", [])]
    return reqs + [Requirement(r) for r in extras.get("gpu", [])]


def _applies(req: Requirement, extras: set[str], python: str) -> bool:
    if req.marker is None:
        return True
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    return any(Marker(str(req.marker)).evaluate({**env, "extra": e}) for e in (extras or {""}))


def closure(roots: list[Requirement], python: str, skip: frozenset[str] = frozenset()) -> dict[str, Pin]:
    """Every installed distribution `roots` need (markers evaluated for `python` on Linux x86_64),
    name -> pin; names in `skip` are not entered. A requirement not installed here is an error:
    the wheelhouse would be incomplete."""
    out: dict[str, Pin] = {}
    todo = [(r, set(r.extras)) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in skip or (name in out and not extras):
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise SystemExit(
                f"wheelhouse: {req.name} is required but not installed in {sys.prefix}; "
                "run this in the project's venv (make wheelhouse)"
            ) from None
        first = name not in out
        out[name] = Pin(name, dist.version)
        for sub in map(Requirement, dist.requires or []):
            if _applies(sub, extras, python) and (first or extras):
                todo.append((sub, set(sub.extras)))
    return out


def build_requirements() -> list[Requirement]:
    """pyproject's [build-system] requires: pip builds the project (`-e .` too) in an isolated
    environment that it fills from the wheelhouse, whatever setuptools the node has."""
    return [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]]


def wheel_set(python: str, with_data: bool) -> list[Pin]:
    node = closure([Requirement(n) for n in NODE_HAS if _installed(n)], python)
    need = closure(project_requirements(with_data), python, skip=frozenset(node))
    pins = sorted(need.values(), key=lambda p: p.name)
    # not necessarily installed here (pip installs them only inside its build environments): the
    # newest release the requirement allows
    return pins + [Pin(canonicalize_name(r.name), "", str(r.specifier)) for r in build_requirements()]


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def download(pins: list[Pin], python: str, out: Path) -> None:
    """The pinned wheels as they are (--no-deps: the closure is already in `pins`); the build
    requirements with their dependencies (pip's build environment starts empty)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "-d",
        str(out),
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + ["--no-deps"] + [p.requirement() for p in pins if p.version], check=True)
    subprocess.run(cmd + [p.requirement() for p in pins if not p.version], check=True)


def wheel_matches(path: Path, pin: Pin, python: str) -> bool:
    """Whether `path` is `pin`'s wheel usable by CPython `python` (py3-none, abi3 or cpXY)."""
    parts = path.name[:-4].split("-")
    if canonicalize_name(parts[0]) != pin.name or (pin.version and parts[1] != pin.version.replace("-", "_")):
        return False
    pytags, abi = parts[-3].split("."), parts[-2]
    return abi in ("none", "abi3") or f"cp{python.replace('.', '')}" in pytags


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "wheelhouse"), help="the folder (default: wheelhouse/)")
    ap.add_argument("--python", default="3.11,3.12", help="target CPython versions, comma-separated")
    ap.add_argument(
        "--with-data",
        action="store_true",
        help="also the `data` extra (Ray, av, decord, scikit-image): the preprocessing job",
    )
    ap.add_argument("--list", action="store_true", help="print the pins and download nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total: set[Path] = set()
    for python in args.python.split(","):
        pins = wheel_set(python, args.with_data)
        if args.list:
            print(f"cp{python.replace('.', '')}: " + " ".join(p.requirement() for p in pins))
            continue
        download(pins, python, out)
        build_deps = [
            Pin(canonicalize_name(w.name.split("-")[0]), "")
            for w in out.glob("*.whl")
            if canonicalize_name(w.name.split("-")[0]) not in {p.name for p in pins}
        ]
        files = [w for w in out.glob("*.whl") if any(wheel_matches(w, p, python) for p in pins + build_deps)]
        total.update(files)
        size = sum(f.stat().st_size for f in files)
        print(
            f"cp{python.replace('.', '')}: {len(files)} wheels, {mb(size)}: "
            + " ".join(sorted(f.name.split("-")[0] for f in files))
        )
    if not args.list:
        print(
            f"wheelhouse {out}: {len(total)} files, {mb(sum(f.stat().st_size for f in total))} "
            f"(without torch{'' if args.with_data else ', Ray, av, decord and scikit-image'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
