"""`mmdata tokenize-images` and `mmdata tiny-vq`: parity of the token grids with transformers'
Emu3ImageProcessor + Emu3VQVAE.encode, the token shard contract (keys, order, records, grids,
quarantine, manifest), energon reading the output, determinism across workers and chunkings,
resume after the driver is killed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmdata import shard_format as sf
from mmdata.shard_job.manifest import stable_view
from mmdata.energon_loaders.emu3 import token_format as tf
from tests.emu3_tiny import (
    EXPECTED_REASONS,
    TEST_IMAGE_AREA,
    dev_samples,
    encode_image,
    hf_codes,
    hf_reference,
    run_tokenize_cli,
    tokenize_args,
)
from tests.energon_reading import energon_samples


def _samples(tar_path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) of every sample of a shard, in order."""
    out: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(tar_path) as t:
        for m in t.getmembers():
            key, _, suffix = m.name.partition(".")
            if not out or out[-1][0] != key:
                out.append((key, {}))
            out[-1][1][suffix] = t.extractfile(m).read()
    return out


def test_tiny_vq_is_deterministic_and_loads_in_transformers(tmp_path, tiny_vq_dir):
    from transformers import Emu3VQVAE

    from mmdata.dev.tiny_vq_model import build_tiny_vq

    again = build_tiny_vq(tmp_path / "again", seed=0)
    other = build_tiny_vq(tmp_path / "other", seed=1)
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_vq_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_vq_dir / "model.safetensors").read_bytes()
    vq = Emu3VQVAE.from_pretrained(tiny_vq_dir)
    assert (
        vq.config.codebook_size == 512 and vq.vision_spatial_factor == 8 and vq.config.temporal_downsample_factor == 4
    )


@pytest.mark.parametrize("area", [TEST_IMAGE_AREA, 96 * 96])
def test_vision_tokenizer_matches_hf_processor_and_encode(tiny_vq_dir, area):
    """Same ids as `Emu3VQVAE.encode(Emu3ImageProcessor(image))`, image by image, for sizes that are
    not multiples of 8, extreme aspects and RGBA/L/P/RGB images, and for a batch of same-size images."""
    from mmdata.vision_tokens.vq import VisionTokenizer

    rng = np.random.default_rng(1)
    proc, vq = hf_reference(tiny_vq_dir, area)
    ours = VisionTokenizer(tiny_vq_dir, area)
    cases = [
        (101, 61, "RGB", "JPEG"),
        (37, 53, "RGBA", "PNG"),
        (64, 64, "L", "PNG"),
        (90, 45, "P", "PNG"),
        (333, 17, "RGB", "PNG"),
        (9, 250, "RGB", "PNG"),
    ]
    images = [Image.open(io.BytesIO(encode_image(rng, w, h, mode, fmt))) for w, h, mode, fmt in cases]
    for img in images:
        grid = ours.encode([ours.preprocess(img)])[0]
        ref = hf_codes(proc, vq, img)
        assert grid.shape == ref.shape and np.array_equal(grid, ref), img
    same = [Image.open(io.BytesIO(encode_image(rng, 120, 70))) for _ in range(3)]
    batch = ours.encode([ours.preprocess(img) for img in same])
    for img, grid in zip(same, batch):
        assert np.array_equal(grid, hf_codes(proc, vq, img))


def test_job_output_matches_hf_and_keeps_keys_order_and_records(token_dir, emu3_dev_shards, tiny_vq_dir):
    proc, vq = hf_reference(tiny_vq_dir, TEST_IMAGE_AREA)
    manifest = json.loads((token_dir / sf.MANIFEST_NAME).read_text())
    quarantined = {json.loads(line)["id"]: json.loads(line) for line in (token_dir / sf.QUARANTINE_NAME).open()}
    n_images = n_tokens = n_text = 0
    in_shards = sorted(emu3_dev_shards.glob("shard-*.tar"))
    assert [s["name"] for s in manifest["shards"]] == [p.name for p in in_shards]
    for in_path in in_shards:
        inputs = _samples(in_path)
        outputs = _samples(token_dir / in_path.name)
        records = {k: json.loads(p["json"]) for k, p in inputs}
        kept = [k for k, _ in inputs if records[k]["id"] not in quarantined]
        assert [k for k, _ in outputs] == kept  # same keys, same order, quarantined ones absent
        by_key = dict(inputs)
        for key, parts in outputs:
            assert parts["json"] == by_key[key]["json"]  # the text record, byte for byte
            record = records[key]
            grids = tf.decode_vq_json(parts["vq.json"])
            assert [g.source for g in grids] == record["images"]
            assert set(parts) == {"json", "vq.json", *(g.member for g in grids)}
            n_text += not grids
            for g in grids:
                grid = np.load(io.BytesIO(parts[g.member]), allow_pickle=False)
                assert grid.dtype == np.dtype("<u2") and grid.shape == (g.height, g.width)
                ref = hf_codes(proc, vq, Image.open(io.BytesIO(by_key[key][g.source])))
                assert np.array_equal(grid, ref), (key, g.source)
                assert g.pixels == [8 * g.height, 8 * g.width]
                n_images += 1
                n_tokens += grid.size
    c = manifest["counts"]
    assert c["read"] == 16 and c["written"] + c["quarantined"] == c["read"] and c["quarantined"] == len(quarantined)
    assert c["tokens"] == {"images": n_images, "visual_tokens": n_tokens, "text_only": n_text} and n_text == 2
    assert manifest["image_area"] == TEST_IMAGE_AREA and manifest["image_processor"]["min_pixels"] == TEST_IMAGE_AREA
    from mmdata.vision_tokens.vq import read_vq_checkpoint

    assert manifest["vision_tokenizer"]["fingerprint"] == read_vq_checkpoint(tiny_vq_dir).fingerprint()
    # every rejected record: its own reason, where it was, nothing else quarantined
    for q in quarantined.values():
        assert q["reason"] == EXPECTED_REASONS[q["id"].rsplit("-", 1)[0]], q
        assert q["source_location"].startswith("shard-") and "0x" not in q["detail"]
    assert sorted(c["by_reason"]) == sorted(EXPECTED_REASONS.values())


def test_energon_reads_token_shards(token_dir):
    """`energon info` and an energon loader (trivial task encoder) over the token shards, through
    our `mmdata.yaml` (the plain `dataset.yaml` without mmdata: test_energon_without_mmdata.py)."""
    from click.testing import CliRunner
    from megatron.energon.cli.main import main as energon_main

    from mmdata.energon_loaders.emu3.vq_token_sample import VQTokenSample

    manifest = json.loads((token_dir / sf.MANIFEST_NAME).read_text())
    written = manifest["counts"]["written"]
    info = CliRunner().invoke(energon_main, ["info", "--dataset-config", "mmdata.yaml", str(token_dir)])
    assert info.exit_code == 0, info.output
    assert "VQTokenSample" in info.output and f"{written} samples" in info.output
    assert "InterleavedSample" in CliRunner().invoke(energon_main, ["info", str(token_dir)]).output

    seen = {}
    for s in energon_samples(token_dir, "mmdata.yaml"):
        assert isinstance(s, VQTokenSample)
        seen[s.__key__] = s
    assert len(seen) == written
    with tarfile.open(token_dir / manifest["shards"][0]["name"]) as t:
        first = t.getmembers()[0].name.split(".")[0]
        parts = {m.name.split(".", 1)[1]: t.extractfile(m).read() for m in t.getmembers() if m.name.startswith(first)}
    sample = next(s for k, s in seen.items() if k.endswith(first))
    grids = tf.decode_vq_json(parts["vq.json"])
    assert len(sample.image_tokens) == len(grids) >= 1
    for g, arr in zip(grids, sample.image_tokens):
        assert np.array_equal(arr, np.load(io.BytesIO(parts[g.member])))
    assert sample.id == json.loads(parts["json"])["id"] and sample.conversations


def test_gpu_check_script_helps_and_skips_without_cuda():
    """`python -m benchmarks.gpu_check_tokenize_images` (run as a program, as its usage line says,
    not imported): --help, and a clear skip line with exit 0 where no CUDA device is visible."""
    repo = Path(__file__).resolve().parents[1]
    script = ["-m", "benchmarks.gpu_check_tokenize_images"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    helped = subprocess.run(
        [sys.executable, *script, "--help"], check=False, capture_output=True, text=True, env=env, cwd=repo
    )
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped.stderr
    assert "loads the VQ once" in helped.stdout and "--num-samples" in helped.stdout
    skipped = subprocess.run([sys.executable, *script], check=False, capture_output=True, text=True, env=env, cwd=repo)
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stdout.strip().splitlines()[-1].startswith("GPU_CHECK skipped: no CUDA device")


def test_cli_help_and_user_errors(tmp_path, emu3_dev_shards, tiny_vq_dir):
    from mmdata.cli import main

    for argv in (["tokenize-images", "--help"], ["tiny-vq", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = tmp_path / "out"
    # a missing VQ dir or input folder: one line, exit 2, before any Ray instance starts
    assert (
        main(
            [
                "tokenize-images",
                str(emu3_dev_shards),
                "--vision-tokenizer",
                str(tmp_path / "nope"),
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "tokenize-images",
                str(tmp_path / "nothing"),
                "--vision-tokenizer",
                str(tiny_vq_dir),
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 2
    )
    assert main(["tiny-vq", "--output", str(out), "--codebook-size", "0"]) == 2
    for flag, value in (("--workers", "0"), ("--gpus-per-worker", "0"), ("--gpus-per-task", "-1")):
        assert (
            main(
                [
                    "tokenize-images",
                    str(emu3_dev_shards),
                    "--vision-tokenizer",
                    str(tiny_vq_dir),
                    "--output",
                    str(out),
                    "--no-progress",
                    flag,
                    value,
                ]
            )
            == 2
        ), flag


def test_each_worker_loads_the_vq_once_across_many_chunks(
    tmp_path, token_dir, emu3_dev_shards, tiny_vq_dir, emu3_tok_dir
):
    """2 workers (actors) over 8 chunks: each loads the VQ once and both get chunks; the bytes
    (length index included) are the fixture run's (2 CPUs, 3 samples per chunk: other workers,
    other chunks)."""
    out = tmp_path / "two_workers"
    run_tokenize_cli(
        *tokenize_args(
            emu3_dev_shards, tiny_vq_dir, out, num_cpus=2, workers=2, chunk_samples=2, tokenizer=emu3_tok_dir
        )
    )
    run = json.loads((out / sf.MANIFEST_NAME).read_text())["run"]
    assert run["chunks"] == 8 and run["workers"] == 2
    assert run["vq_loads"] == [1, 1] and run["worker_restarts"] == [0, 0]
    assert sum(run["worker_chunks"]) == 8 and min(run["worker_chunks"]) >= 1, run["worker_chunks"]
    _assert_same_output(out, token_dir)


@pytest.mark.slow
def test_resumed_chunks_are_read_without_workers(tmp_path, token_dir, emu3_dev_shards, tiny_vq_dir, emu3_tok_dir):
    """A job stopped after its tokenize stage: the rerun reads every finished chunk in the driver,
    starts no worker (loads no VQ) and writes the same bytes."""
    out = tmp_path / "resumed"
    code = (
        "import sys; from pathlib import Path; from mmdata.vision_tokens.job import TokenizeConfig, run_tokenize; "
        "a = sys.argv[1:]; run_tokenize(TokenizeConfig(Path(a[0]), Path(a[1]), Path(a[2]), image_area=int(a[3]), "
        "num_cpus=2, chunk_samples=3, progress=False, keep_work_dir=True, tokenizer=Path(a[4])))"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(emu3_dev_shards),
            str(tiny_vq_dir),
            str(out),
            str(TEST_IMAGE_AREA),
            str(emu3_tok_dir),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    (out / sf.MANIFEST_NAME).unlink()  # as if the driver died after the tokenize stage
    for p in out.glob("shard-*.tar*"):
        p.unlink()
    for p in (out / ".mmdata-work" / "shards").iterdir():
        p.unlink()
    run_tokenize_cli(
        *tokenize_args(emu3_dev_shards, tiny_vq_dir, out, num_cpus=2, chunk_samples=3, tokenizer=emu3_tok_dir)
    )
    run = json.loads((out / sf.MANIFEST_NAME).read_text())["run"]
    assert run["resumed"]["chunks"] == run["chunks"] > 0 and run["resumed"]["shards"] == 0
    assert run["workers"] == 0 and run["vq_loads"] == []
    _assert_same_output(out, token_dir)


@pytest.mark.slow
def test_deterministic_across_workers_and_chunks(tmp_path, token_dir, emu3_dev_shards, tiny_vq_dir, emu3_tok_dir):
    """1 CPU and 5 samples per chunk gives the bytes of the 2-CPU, 3-per-chunk fixture run."""
    out = tmp_path / "one_cpu"
    run_tokenize_cli(
        *tokenize_args(emu3_dev_shards, tiny_vq_dir, out, num_cpus=1, chunk_samples=5, tokenizer=emu3_tok_dir)
    )
    _assert_same_output(out, token_dir)


def _assert_same_output(out: Path, ref: Path) -> None:
    m_out, m_ref = (json.loads((d / sf.MANIFEST_NAME).read_text()) for d in (out, ref))
    assert stable_view(m_out) == stable_view(m_ref)
    for s in m_ref["shards"]:
        assert (out / s["name"]).read_bytes() == (ref / s["name"]).read_bytes(), s["name"]
        idx = s["name"][: -len(".tar")] + ".tar.idx"
        assert (out / idx).read_bytes() == (ref / idx).read_bytes()
    assert (out / sf.QUARANTINE_NAME).read_bytes() == (ref / sf.QUARANTINE_NAME).read_bytes()
    out_lengths, ref_lengths = (d / "lengths.parquet" for d in (out, ref))  # (with --tokenizer)
    assert out_lengths.exists() == ref_lengths.exists()
    assert not ref_lengths.exists() or out_lengths.read_bytes() == ref_lengths.read_bytes()


@pytest.fixture(scope="module")
def kill_case(tmp_path_factory, tiny_vq_dir):
    """64 samples in 2-sample chunks (enough to kill the job midway) and an uninterrupted run's output."""
    from mmdata.dev.shards import write_dev_shards

    root = tmp_path_factory.mktemp("tokenize_kill")
    shards = write_dev_shards(root / "in", dev_samples(64, seed=5), samples_per_shard=16)
    common = ["--num-cpus", "1", "--chunk-samples", "2", "--image-area", str(128 * 128)]
    ref = root / "ref"
    run_tokenize_cli(*tokenize_args(shards, tiny_vq_dir, ref, *common))
    return shards, ref, common


def _start_job(shards: Path, vq: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "mmdata.vision_tokens.cli", "--no-progress", *tokenize_args(shards, vq, out, *extra)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


def _wait_for_chunks(proc: subprocess.Popen, out: Path, n: int) -> None:
    chunks = out / ".mmdata-work" / "chunks"
    while proc.poll() is None and len(list(chunks.glob("*.json"))) < n:
        time.sleep(0.02)
    assert proc.poll() is None, "job finished before it could be killed: make the test input bigger"


@pytest.mark.slow
def test_killed_driver_rerun_gives_same_output(tmp_path, kill_case, tiny_vq_dir):
    """SIGKILL the driver once some chunks are done, rerun: the rest is finished (finished chunks
    are not sent to workers again) and the output equals an uninterrupted run's."""
    shards, ref, common = kill_case
    out = tmp_path / "out"
    proc = _start_job(shards, tiny_vq_dir, out, *common)
    _wait_for_chunks(proc, out, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / sf.MANIFEST_NAME).exists()
    run_tokenize_cli(*tokenize_args(shards, tiny_vq_dir, out, *common))
    run = json.loads((out / sf.MANIFEST_NAME).read_text())["run"]
    assert run["resumed"]["chunks"] >= 3
    assert sum(run["worker_chunks"]) == run["chunks"] - run["resumed"]["chunks"]
    _assert_same_output(out, ref)
    assert not (out / ".mmdata-work").exists()


def _descendants_named(root_pid: int, prefix: str) -> list[int]:
    """Processes under `root_pid` whose command line starts with `prefix` (Ray's process titles)."""
    parents, found = {}, []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if cmdline.startswith(prefix):
            found.append(int(d.name))

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root_pid:
                return True
        return False

    return [p for p in found if under(p)]


@pytest.mark.slow
def test_killed_worker_is_restarted_and_its_chunks_resent(tmp_path, kill_case, tiny_vq_dir):
    """SIGKILL one tokenizing worker (an actor process) mid-job: Ray restarts it, its chunks are
    sent again, the job finishes in the same run with the uninterrupted run's bytes."""
    shards, ref, common = kill_case
    out = tmp_path / "out"
    proc = _start_job(shards, tiny_vq_dir, out, "--num-cpus", "2", "--workers", "2", *common[2:])
    _wait_for_chunks(proc, out, 3)
    # a worker process that has loaded its VQ (it wrote its load record), found under the job
    loaded = {int(p.name.rsplit(".", 2)[1]) for p in (out / ".mmdata-work" / "workers").glob("w*.json")}
    victims = [p for p in _descendants_named(proc.pid, "ray::TokenizeWorker") if p in loaded]
    assert victims, "no TokenizeWorker process with a loaded VQ found under the job"
    os.kill(victims[0], signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    run = json.loads((out / sf.MANIFEST_NAME).read_text())["run"]
    assert sorted(run["worker_restarts"]) == [0, 1] and run["workers"] == 2
    assert sorted(run["vq_loads"]) == [1, 2]  # once per process: the restarted worker's new one loaded it again
    assert sum(run["worker_chunks"]) == run["chunks"]
    _assert_same_output(out, ref)


@pytest.mark.slow
def test_gpu_style_tasks_would_reload_the_vq_for_every_chunk(tmp_path, emu3_dev_shards, tiny_vq_dir):
    """Why the job uses actors: Ray runs a GPU task (num_gpus > 0) with max_calls=1, a fresh
    worker process per task. The same with max_calls=1 set by hand on CPU: the per-process VQ
    load count is 1 in every task, i.e. one load per chunk, where a worker loads once."""
    code = """
import json, sys
import ray
from mmdata.vision_tokens import stages
from mmdata.vision_tokens.vq import read_vq_checkpoint

shards, vq, work = sys.argv[1:]
opts = stages.TokenizeOptions(shards, work, vq, read_vq_checkpoint(vq).fingerprint(), 64 * 64, "cpu", 1, 1)

def one_chunk(spec):
    import os
    stages.tokenize_chunk(spec, opts, stages.load_vision_tokenizer(opts))
    return os.getpid(), stages.vq_loads_in_process()

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
task = ray.remote(num_cpus=1, max_calls=1)(one_chunk)
specs = [stages.ChunkSpec("shard-000000.tar", i, 2 * i, 2 * i + 2) for i in range(4)]
print(json.dumps(ray.get([task.remote(s) for s in specs])))
"""
    work = tmp_path / "work"
    (work / "chunks").mkdir(parents=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", code, str(emu3_dev_shards), str(tiny_vq_dir), str(work)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [loads for _, loads in results] == [1, 1, 1, 1]  # every task's process loaded the VQ itself
    assert len({pid for pid, _ in results}) == 4  # in 4 processes: 4 loads for 4 chunks
