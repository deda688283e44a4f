"""The preprocessing job's helpers and session fixtures (registered in tests/conftest.py).

`synth_raw_dir`: 120 synthetic Infinity-MM records (seed 0, no broken ones) in the real on-disk
layout (stageN/<subset>/*.tar). `shards_dir`: that dataset through `mmdata preprocess` (seed 0,
32 samples per shard, local Ray with 2 CPUs) -> energon-ready shards + manifest. Both are
session-scoped and read-only for tests: copy before modifying.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mmdata import shard_format as sf
from tests.cli_runs import flags, run_module

SYNTH_NUM_SAMPLES = 120
SYNTH_SEED = 0
SHARDS_SAMPLES_PER_SHARD = 32
#: the console scripts of this interpreter's environment (`ray start` for the cluster tests)
VENV_BIN = Path(sys.executable).parent


def run_preprocess_cli(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mmdata preprocess` in a subprocess (its own Ray instance, nothing left in pytest)."""
    full_env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **(env or {})}
    return run_module("mmdata.preprocess.cli", "--no-progress", *args, env=full_env, check=check)


def run_preprocess(
    raw: Path,
    out: Path,
    *args: str,
    dataset: str = "infinity-mm",
    check: bool = True,
    env: dict | None = None,
    **options: object,
) -> subprocess.CompletedProcess:
    """`mmdata preprocess --dataset DATASET --input RAW --output OUT`, the other options as keywords
    (`samples_per_shard=40` -> `--samples-per-shard 40`, see tests/cli_runs.py) and `args` after them."""
    return run_preprocess_cli(*flags(dataset=dataset, input=raw, output=out, **options), *args, check=check, env=env)


@pytest.fixture(scope="session")
def synth_raw_dir(tmp_path_factory) -> Path:
    from mmdata.dev.synth import generate_records, write_infinity_mm

    out = tmp_path_factory.mktemp("synth") / "raw"
    write_infinity_mm(generate_records(SYNTH_NUM_SAMPLES, seed=SYNTH_SEED, synthetic=True), out, samples_per_tar=20)
    return out


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, synth_raw_dir) -> Path:
    out = tmp_path_factory.mktemp("shards") / "shards"
    run_preprocess(synth_raw_dir, out, seed=SYNTH_SEED, samples_per_shard=SHARDS_SAMPLES_PER_SHARD, num_cpus=2)
    return out


def tokenized_shards(
    root: Path, records: int, seed: int, samples_per_tar: int, samples_per_shard: int
) -> tuple[Path, Path]:
    """(shards, tokenizer dir): `records` synthetic records (generated with `seed`) through the job with
    the tiny Qwen2 tokenizer, so the length index holds exact text tokens (job seed 1, 2 CPUs)."""
    from mmdata.dev.synth import generate_records, write_infinity_mm
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    tok = build_tiny_qwen2_tokenizer(root / "tok")
    write_infinity_mm(
        generate_records(records, seed=seed, synthetic=True), root / "raw", samples_per_tar=samples_per_tar
    )
    out = root / "shards"
    run_preprocess(root / "raw", out, seed=1, samples_per_shard=samples_per_shard, num_cpus=2, tokenizer=tok)
    return out, tok


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a Ray head, a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_shards(out: Path) -> list[tuple[str, dict, dict[str, bytes], list[tarfile.TarInfo]]]:
    """[(key, record, {suffix: bytes}, tarinfos)] in output order, asserting contiguous sorted members."""
    samples: list = []
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                key, _, suffix = info.name.partition(".")
                if not samples or samples[-1][0] != key:
                    assert all(s[0] != key for s in samples), f"members of {key} not contiguous"
                    samples.append((key, None, {}, []))
                members = samples[-1][2]
                assert not members or suffix > max(members), f"{info.name}: members not sorted"
                members[suffix] = tar.extractfile(info).read()
                samples[-1][3].append(info)
    return [(k, json.loads(m[sf.JSON_MEMBER]), m, infos) for k, _, m, infos in samples]


def start_ray_node(*args: str, env_extra: dict[str, str] | None = None, attempts: int = 2) -> subprocess.Popen:
    """`ray start ... --block` in its own process group, once it says it is up. Tried once more
    when it does not come up: Ray waits a fixed 30 s for its raylet (ray/_private/node.py), which a
    busy machine can miss, as `mmdata.ray_job.init_ray` retries its own start."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env_extra or {})}
    command = [str(VENV_BIN / "ray"), "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *args, "--block"]
    lines: list[str] = []
    for _ in range(attempts):
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        for line in proc.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                return proc
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of this try is left, before the next
        proc.wait()
    raise AssertionError(f"ray start failed {attempts} times:\n" + "".join(lines))
