"""A GPU node without a package index, simulated on this CPU host (issue 43): a fresh venv holding
only torch (the CPU build CI uses, installed offline), transformers and pytest, as a node's image
does; the project installed from `scripts/wheelhouse.py`'s folder with `--no-index`; the gpu tier
collects; `gpu_smoke.py --allow-cpu` passes env, build and trainer.

Downloads (the node's own packages, the wheelhouse) go to .cache/airgap/ (git ignores it) and are
reused while their pins are unchanged, so a second run only builds the venv. Each phase's seconds
are printed (`-s` shows them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "airgap"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
#: what the node brings: pinned to this venv's versions (torch is the CPU build CI installs)
NODE = tuple(f"{n}=={version(n)}" for n in ("torch", "transformers", "pytest"))

pytestmark = pytest.mark.slow


def sh(*cmd: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, env=env)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


def cached(folder: Path, key: str, fill) -> Path:
    """`folder` filled by `fill(folder)` once per `key` (the pins it was made from)."""
    stamp = folder / ".stamp"
    if not (stamp.exists() and stamp.read_text() == key):
        folder.mkdir(parents=True, exist_ok=True)
        fill(folder)
        stamp.write_text(key)
    return folder


def node_env(venv: Path) -> dict[str, str]:
    """The venv's interpreter alone: no PYTHONPATH (it would reach this venv's packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_install_from_the_wheelhouse_collects_the_gpu_tier_and_passes_the_smoke_checks(tmp_path):
    times: dict[str, float] = {}

    def phase(name: str, start: float) -> None:
        times[name] = time.monotonic() - start
        print(f"airgap phase {name}: {times[name]:.1f} s", flush=True)

    t = time.monotonic()
    pins = sh(sys.executable, "scripts/wheelhouse.py", "--list", "--python", PY) + "build deps v2"
    wheels = cached(
        CACHE / "wheelhouse",
        pins,
        lambda d: sh(sys.executable, "scripts/wheelhouse.py", "--out", str(d), "--python", PY),
    )
    phase("wheelhouse (download, cached)", t)

    t = time.monotonic()
    node_wheels = cached(
        CACHE / f"node-cp{PY.replace('.', '')}",
        " ".join(NODE),
        lambda d: sh(sys.executable, "-m", "pip", "download", "--quiet", "-d", str(d), *NODE),
    )
    phase("node packages (download, cached)", t)

    t = time.monotonic()
    python = str(Path(sys.base_prefix) / "bin" / f"python{PY}")

    def node_image(folder: Path) -> None:
        sh(python, "-m", "venv", "--clear", str(folder))
        sh(
            str(folder / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(node_wheels),
            *NODE,
            env=node_env(folder),
        )

    image = cached(CACHE / f"node-image-cp{PY.replace('.', '')}", " ".join(NODE), node_image)
    phase("node image: torch, transformers, pytest installed offline (cached)", t)

    t = time.monotonic()
    # a fresh venv that sees the image's packages as a node's interpreter sees its preinstalled ones
    # (a .pth entry: pip counts them as installed and installs the project beside them)
    venv = tmp_path / "node"
    sh(python, "-m", "venv", str(venv))
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "node_image.pth").write_text(str(next((image / "lib").glob("python*/site-packages"))) + "\n")
    py = str(venv / "bin" / "python")
    env = node_env(venv)
    phase("fresh venv over the node image", t)

    t = time.monotonic()
    torch_before = sh(py, "-c", "import torch; print(torch.__version__, torch.__file__)", env=env)
    sh(py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels), "-e", f"{REPO}[gpu]", env=env)
    phase("project from the wheelhouse (--no-index)", t)
    assert sh(py, "-c", "import torch; print(torch.__version__, torch.__file__)", env=env) == torch_before
    listed = {line.split("==")[0].lower() for line in sh(py, "-m", "pip", "freeze", env=env).splitlines()}
    assert not {"ray", "av", "decord", "scikit-image"} & listed, listed  # the data extra stays out

    t = time.monotonic()
    out = sh(py, "-m", "pytest", "--co", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu", env=env)
    phase("pytest --co -m gpu tests/gpu", t)
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    assert collected and int(collected.group(1)) >= 20, out[-2000:]

    t = time.monotonic()
    work = tmp_path / "smoke"
    proc = subprocess.run(
        [py, "benchmarks/gpu_smoke.py", "--allow-cpu", "--quick", "--only", "env,build,trainer", "--report", str(work)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    phase("gpu_smoke.py --allow-cpu env,build,trainer", t)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((work / "report.json").read_text())
    assert {c["name"]: c["status"] for c in report["checks"]} == {"env": "PASS", "build": "PASS", "trainer": "PASS"}
    print("airgap phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
