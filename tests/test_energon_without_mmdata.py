"""Our shards are read by plain energon where mmdata is not installed (issue 31): `.nv-meta/
dataset.yaml` names energon's own `InterleavedSample`, built by a self-contained
`sample_loader.py`; our loaders read `mmdata.yaml` (our sample types) instead.

The checks run in subprocesses in which `mmdata` and `mmtrain` cannot be imported (a
sitecustomize installs a meta-path finder refusing them; the cwd and PYTHONPATH are outside
the repo): `energon info`, `energon lint` and `energon preview` with their defaults, and
`get_train_dataset` + `get_loader` with energon's `DefaultTaskEncoder`, over preprocess output
and over VQ token shards. Also: the loader with decoding off (bytes), the fallback for folders
written before `mmdata.yaml`, and the blends our loader writes.
"""

from __future__ import annotations

import ast
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from mmdata import shard_format as sf
from mmdata.energon_configs import config_sample_type, dataset_config
from mmdata.shard_job import energon_sample_loader as portable
from mmdata.shard_job.energon_meta import NV_META
from tests.energon_reading import energon_samples, plain_train_dataset

NO_MMDATA = '''\
import sys


class _NoMmdata:
    """Stands for a machine without mmdata: importing it (or mmtrain) fails."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mmdata", "mmtrain"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None


sys.meta_path.insert(0, _NoMmdata())
'''

# What a plain energon user runs, in one process (one energon import): the `energon` CLI's
# `info`, `lint` and `preview` with their defaults (as the `energon` script calls them; preview's
# "Continue?" gets end of input, i.e. no), then a DefaultTaskEncoder loop. Prints one JSON line.
PLAIN_ENERGON = """\
import json, sys
import torch
from click.testing import CliRunner
from megatron.energon import DefaultTaskEncoder, InterleavedSample, WorkerConfig, get_loader, get_train_dataset
from megatron.energon.cli.main import main

path, n = sys.argv[1], int(sys.argv[2])
cli = {}
for command in ("info", "lint", "preview"):
    result = CliRunner().invoke(main, [command, path], input="")
    cli[command] = {"exit_code": result.exit_code, "output": result.output,
                    "exception": repr(result.exception) if result.exit_code else None}
ds = get_train_dataset(path, batch_size=1, shuffle_buffer_size=None, max_samples_per_sequence=None,
                       worker_config=WorkerConfig.default_worker_config(0), task_encoder=DefaultTaskEncoder())
seen = {}
for i, batch in enumerate(get_loader(ds)):
    assert isinstance(batch, InterleavedSample), type(batch)
    items = []
    for x in batch.sequence[0]:
        if isinstance(x, str):
            items.append({"text": x})
        else:
            assert isinstance(x, torch.Tensor), type(x)
            items.append({"shape": list(x.shape), "dtype": str(x.dtype), "sum": float(x.double().sum())})
    seen[batch.__key__[0]] = items
    if len(seen) == n or i > 3 * n:
        break
print(json.dumps({"cli": cli, "samples": seen}))
"""


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A cwd outside the repo whose sitecustomize.py blocks mmdata and mmtrain."""
    site = tmp_path_factory.mktemp("no_mmdata")
    (site / "sitecustomize.py").write_text(NO_MMDATA)
    (site / "plain_energon.py").write_text(PLAIN_ENERGON)
    return site


def _run(bare: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=bare, env=_env(bare), input=stdin, capture_output=True, text=True
    )
    return proc


def _plain_energon(bare: Path, folder: Path, n: int) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """The CLI outputs and the samples of PLAIN_ENERGON over `folder`, run where mmdata is blocked."""
    proc = _run(bare, "plain_energon.py", str(folder), str(n))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for command, r in result["cli"].items():
        assert r["exit_code"] == 0, (command, r["exception"], r["output"][-3000:], proc.stderr[-3000:])
    return {c: r["output"] for c, r in result["cli"].items()}, result["samples"]


def _records(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every sample's members, by key, read straight from the tars."""
    samples: dict[str, dict[str, bytes]] = {}
    for tar_path in sorted(folder.glob("shard-*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                key, _, part = m.name.partition(".")
                samples.setdefault(key, {})[part] = tar.extractfile(m).read()
    return samples


def _turns_text(record: dict) -> str:
    return "\n".join(f"{t['from']}: {t['value']}" for t in record["conversations"])


def _joined(items: list[dict]) -> str:
    return "".join(x["text"] if "text" in x else sf.IMAGE_PLACEHOLDER for x in items)


def test_the_blocker_blocks(bare):
    proc = _run(bare, "-c", "import mmdata")
    assert proc.returncode != 0 and "blocked by the test" in proc.stderr, proc.stderr
    assert _run(bare, "-c", "import megatron.energon").returncode == 0


def test_written_loader_is_the_self_contained_module(shards_dir):
    """`.nv-meta/sample_loader.py` is energon_sample_loader.py, which imports no mmdata."""
    source = Path(portable.__file__).read_text()
    assert (shards_dir / NV_META / "sample_loader.py").read_text() == source
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert imported <= {"__future__", "io", "json", "re", "numpy", "torch"}, imported
    meta = shards_dir / NV_META
    assert yaml.safe_load((meta / "dataset.yaml").read_text())["sample_type"] == {
        "__module__": "megatron.energon",
        "__class__": "InterleavedSample",
    }
    assert yaml.safe_load((meta / "mmdata.yaml").read_text())["sample_type"] == {
        "__module__": "mmdata.energon_loaders.sample",
        "__class__": "ConversationSample",
    }
    assert dataset_config(shards_dir) == "mmdata.yaml"
    assert config_sample_type(shards_dir) == "mmdata.energon_loaders.sample.ConversationSample"


def _read_by_plain_energon(bare, folder: Path) -> tuple[dict, dict]:
    """(records, what the plain loop saw) after energon info, lint and preview passed on `folder`."""
    records = _records(folder)
    out, seen = _plain_energon(bare, folder, len(records))
    assert "InterleavedSample" in out["info"] and f"{len(records)} samples" in out["info"], out["info"]
    assert "Skipping empty split part val" in out["lint"], out["lint"]
    assert "Sample 0" in out["preview"] and "sequence" in out["preview"], out["preview"]
    assert sorted(seen) == sorted(records)
    for key, items in seen.items():  # every sample's text is its record's turns
        assert _joined(items) == _turns_text(json.loads(records[key][sf.JSON_MEMBER])), key
    return records, seen


def test_preprocess_shards_read_by_plain_energon(bare, shards_dir):
    records, seen = _read_by_plain_energon(bare, shards_dir)
    with_images = 0
    for key, items in seen.items():
        record = json.loads(records[key][sf.JSON_MEMBER])
        images = [x for x in items if "shape" in x]
        assert len(images) == len(record["images"]), key
        for item, name in zip(images, record["images"]):
            w, h = Image.open(io.BytesIO(records[key][name])).size
            assert item["shape"] == [3, h, w] and item["dtype"] == "torch.float32", (key, name)
        with_images += bool(images)
    assert with_images > 0


def test_token_shards_read_by_plain_energon(bare, demo_token_dir):
    records, seen = _read_by_plain_energon(bare, demo_token_dir)
    grids_seen = 0
    for key, items in seen.items():
        grids = json.loads(records[key]["vq.json"])["grids"]
        tensors = [x for x in items if "shape" in x]
        assert len(tensors) == len(grids), key
        for item, g in zip(tensors, grids):
            grid = np.load(io.BytesIO(records[key][g["member"]]), allow_pickle=False)
            assert item["shape"] == [g["height"], g["width"]] == list(grid.shape)
            assert item["dtype"] == "torch.int64" and item["sum"] == float(grid.astype(np.int64).sum())
        grids_seen += len(grids)
    assert grids_seen > 0
    assert config_sample_type(demo_token_dir) == "mmdata.energon_loaders.emu3.vq_token_sample.VQTokenSample"


@pytest.mark.unit
def test_loader_with_decoding_off_hands_over_bytes():
    """A task encoder with `decoder = None` gets the stored bytes at each placeholder."""
    record = {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "<video>\nand <image> then <image>"},
            {"from": "gpt", "value": "ok <image>"},
        ],
        "images": ["img00.jpg", "img01.png"],
        "video": "video.mp4",
    }
    raw = {"json": json.dumps(record).encode(), "img00.jpg": b"J", "img01.png": b"P", "video.mp4": b"V"}
    assert portable.sample_loader(raw)["sequence"] == [
        "human: ",
        b"V",
        "\nand ",
        b"J",
        " then ",
        b"P",
        "\ngpt: ok <image>",
    ]
    # decoded record (dict), no placeholder: media appended after the text
    raw = {
        "json": {"id": "b", "conversations": [{"from": "human", "value": "hi"}], "images": ["img00.jpg"]},
        "img00.jpg": b"J",
    }
    assert portable.sample_loader(raw)["sequence"] == ["human: hi", b"J"]
    # token shards: the grids as int64 tensors, from raw .npy bytes or decoded arrays
    buf = io.BytesIO()
    np.save(buf, np.arange(6, dtype="<u2").reshape(2, 3), allow_pickle=False)
    vq = {"grids": [{"member": "img00.npy", "source": "img00.jpg", "height": 2, "width": 3, "pixels": [32, 48]}]}
    for grid in (buf.getvalue(), np.arange(6, dtype="<u2").reshape(2, 3)):
        seq = portable.sample_loader(
            {"json": json.dumps(record).encode(), "vq.json": json.dumps(vq).encode(), "img00.npy": grid}
        )["sequence"]
        assert seq[0] == "human: <video>\nand " and seq[1].dtype.is_floating_point is False
        assert seq[1].tolist() == [[0, 1, 2], [3, 4, 5]] and str(seq[1].dtype) == "torch.int64"
    assert all(portable.part_filter(p) for p in ("json", "vq.json", "img00.jpg", "img03.npy", "video.webm"))
    assert not portable.part_filter("txt")


def _identity_ids(path: Path, config: str, take: int | None = None) -> list[str]:
    """`type:id` of the train split's samples as energon hands them over."""
    return [type(s).__name__ + ":" + s.id for s in energon_samples(path, config or None, take)]


def test_folder_without_mmdata_yaml_reads_dataset_yaml_as_before(shards_dir, tmp_path):
    """A shard set written before `mmdata.yaml`: dataset.yaml names our type, and our readers use it."""
    from mmdata.shard_job.energon_meta import mmdata_sample_loader_py

    old = tmp_path / "old"
    (old / NV_META).mkdir(parents=True)
    for f in shards_dir.glob("shard-*"):
        (old / f.name).symlink_to(f)
    shutil.copy(shards_dir / sf.MANIFEST_NAME, old / sf.MANIFEST_NAME)
    for name in ("index.sqlite", "index.uuid", ".info.json", "split.yaml"):
        shutil.copy(shards_dir / NV_META / name, old / NV_META / name)
    # what energon_meta.py wrote before: our type in dataset.yaml, the re-exporting sample_loader.py
    (old / NV_META / "dataset.yaml").write_text(
        textwrap.dedent("""\
        sample_type:
          __module__: mmdata.energon_loaders.sample
          __class__: ConversationSample
        sample_loader: sample_loader.py:sample_loader
        part_filter: sample_loader.py:part_filter
        """)
    )
    (old / NV_META / "sample_loader.py").write_text(mmdata_sample_loader_py())
    assert dataset_config(old) == "dataset.yaml"
    assert config_sample_type(old) == "mmdata.energon_loaders.sample.ConversationSample"
    new_ids = _identity_ids(shards_dir, dataset_config(shards_dir))
    assert _identity_ids(old, dataset_config(old)) == new_ids
    assert all(i.startswith("ConversationSample:") for i in new_ids)

    # our blend names `mmdata.yaml` for new folders only, and energon reads both as our type
    from mmdata.energon_loaders.loader import write_blend_yaml
    from mmdata.readiness import data_source_samples

    blend = write_blend_yaml(tmp_path / "blend.yaml", [(shards_dir, 1.0), (old, 1.0)])
    entries = yaml.safe_load(blend.read_text())["splits"]["train"]["blend"]
    assert [e.get("dataset_config") for e in entries] == ["mmdata.yaml", None]
    assert len(data_source_samples(blend)) == 2  # ready for our loaders
    ids = _identity_ids(blend, "", take=3 * len(new_ids))
    assert set(ids) == set(new_ids)


def test_our_task_encoder_names_a_plain_dataset_yaml_read(shards_dir, tmp_path):
    """Our task encoder given the folder through its plain dataset.yaml (energon's standard type)
    stops on the first sample, naming the config to pass, not an attribute error."""
    from megatron.energon import get_loader
    from megatron.energon.errors import FatalSampleError

    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    encoder = LlavaOVTaskEncoder(
        str(build_tiny_qwen2_tokenizer(tmp_path / "tok")), LlavaOVEncoderConfig(seq_length=4096)
    )
    ds = plain_train_dataset(shards_dir, encoder)
    with pytest.raises(
        FatalSampleError,
        match=r"reads ConversationSample samples, got InterleavedSample.*"
        r"dataset_config='mmdata.yaml'",
    ):
        next(iter(get_loader(ds)))
