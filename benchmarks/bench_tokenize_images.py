"""Benchmark `mmdata tokenize-images` against a plain loop over transformers' Emu3 processor + VQ.

Both tokenize the same images of the same shards with the same VQ model (the tiny random one
from `mmdata tiny-vq` by default, or real weights with --vision-tokenizer) on the same cores:

- baseline: one process, `torch.set_num_threads(num_cpus)`, for every image: PIL decode,
  `Emu3ImageProcessor(images=[img])`, `Emu3VQVAE.encode(...)` (what a user of transformers
  writes; reads the shard tars with `tarfile`, writes nothing).
- ours: the Ray job as a subprocess with --num-cpus, cold (starts and stops its own Ray
  instance, writes token shards, energon index and manifest). Throughput from its manifest's
  wall time (Ray start included) and end to end (interpreter start-up included).

Images/s/core = images / seconds / num_cpus. Peak memory: the baseline process's peak RSS; for
ours, the peak of the summed RSS of the driver and every process it starts (Ray's GCS, raylet,
workers), sampled every 100 ms. The token grids of both are compared (they must be equal).

    .venv/bin/python -m benchmarks.bench_tokenize_images [--quick] [--num-samples 48]
        [--num-cpus 2] [--image-area 65536] [--vision-tokenizer VQ_DIR]

Ends with `BENCH tokenize_images baseline=<x> ours=<y> unit=images/s/core ratio=<ours/baseline>`
(the job's own wall time) and `BENCH tokenize_images_e2e ...` (end to end).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ray_job_env, tokenize_images_args

BASELINE = r"""
import io, json, resource, sys, tarfile, time
import torch
from PIL import Image
from transformers import Emu3ImageProcessor, Emu3VQVAE

shards, vq_dir, area, threads, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
torch.set_num_threads(threads)
torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
torch.backends.cuda.matmul.allow_tf32 = False
t0 = time.perf_counter()
proc = Emu3ImageProcessor.from_pretrained(vq_dir, min_pixels=area, max_pixels=area)
vq = Emu3VQVAE.from_pretrained(vq_dir).eval().to(device)
codes = {}
import pathlib
for tar_path in sorted(pathlib.Path(shards).glob("shard-*.tar")):
    with tarfile.open(tar_path) as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    for name in sorted(members):
        key, _, suffix = name.partition(".")
        if suffix != "json":
            continue
        for image in json.loads(members[name])["images"]:
            inputs = proc(images=[Image.open(io.BytesIO(members[f"{key}.{image}"]))], return_tensors="pt")
            with torch.no_grad():
                grid = vq.encode(inputs["pixel_values"].to(device), inputs["image_sizes"]).image_tokens[0]
            codes[f"{key}.{image}"] = grid.cpu().tolist()
wall = time.perf_counter() - t0
json.dump(codes, open(out, "w"))
print("RESULT=" + json.dumps({"images": len(codes), "wall_s": wall,
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
"""


def make_input(root: Path, n: int, seed: int) -> Path:
    """n single-image records of varied sizes (multiples of 8 or not), aspects and modes."""
    from PIL import Image

    from mmdata.dev.shards import DevSample, write_dev_shards

    rng = np.random.default_rng(seed)
    sizes = [(640, 480), (480, 640), (512, 512), (333, 222), (1024, 256), (201, 399), (800, 600), (96, 96)]
    samples = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        conv = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Noise."}]
        samples.append(DevSample(f"b{i}", conv, [("jpg", buf.getvalue())]))
    return write_dev_shards(root / "shards", samples, samples_per_shard=16)


class _TreeRss(threading.Thread):
    """Peak of the summed RSS of a process and all its descendants, sampled every 100 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._done.wait(0.1)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def run_baseline(shards: Path, vq: Path, area: int, num_cpus: int, codes_out: Path, device: str = "cpu") -> dict:
    """The plain transformers loop in a subprocess; its grids go to `codes_out` (JSON)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", BASELINE, str(shards), str(vq), str(area), str(num_cpus), str(codes_out), device],
        capture_output=True,
        text=True,
        env=ray_job_env(),
    )
    if proc.returncode:
        raise RuntimeError(f"baseline failed:\n{proc.stderr[-3000:]}")
    res = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT="))[7:])
    return {**res, "e2e_s": time.perf_counter() - t0}


def run_ours(shards: Path, vq: Path, area: int, num_cpus: int, out: Path) -> dict:
    options = ("--num-cpus", str(num_cpus), "--no-progress", "--overwrite")
    cmd = [sys.executable, "-m", "mmdata.vision_tokens.cli", *tokenize_images_args(shards, vq, out, area, *options)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ray_job_env())
    rss = _TreeRss(p.pid)
    rss.start()
    stdout, stderr = p.communicate()
    e2e = time.perf_counter() - t0
    peak = rss.stop()
    if p.returncode:
        raise RuntimeError(f"mmdata tokenize-images failed:\n{stdout}\n{stderr[-3000:]}")
    m = json.loads((out / "manifest.json").read_text())
    return {
        "images": m["counts"]["tokens"]["images"],
        "wall_s": m["wall_time_s"],
        "e2e_s": e2e,
        "peak_rss_mb": peak / 2**20,
        "phases": m["run"]["phases"],
    }


def tar_members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def read_grids(out: Path) -> dict[str, np.ndarray]:
    """{"<key>.<source image member>": code grid} of a token shard folder."""
    found = {}
    for tar_path in sorted(out.glob("shard-*.tar")):
        members = tar_members(tar_path)
        for name, data in members.items():
            key, _, suffix = name.partition(".")
            if suffix == "vq.json":
                for g in json.loads(data)["grids"]:
                    found[f"{key}.{g['source']}"] = np.load(
                        io.BytesIO(members[f"{key}.{g['member']}"]), allow_pickle=False
                    )
    return found


def compare_codes(codes_path: Path, out: Path) -> int:
    """Number of images whose grids differ between the baseline and our shards."""
    ref = json.loads(codes_path.read_text())
    ours = read_grids(out)
    return sum(ours.get(k) is None or ours[k].tolist() != v for k, v in ref.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small and fast: 16 images at 64x64 pixels")
    p.add_argument("--num-samples", type=int, default=48, help="images (one per record; default 48)")
    p.add_argument("--num-cpus", type=int, default=2, help="cores for both sides (default 2)")
    p.add_argument("--image-area", type=int, default=256 * 256, help="pixels per image (default 65536)")
    p.add_argument("--vision-tokenizer", type=Path, default=None, help="VQ dir (default: a tiny random one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_samples, args.image_area = 16, 64 * 64
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        root = Path(tmp)
        vq = args.vision_tokenizer
        if vq is None:
            from mmdata.dev.tiny_vq_model import build_tiny_vq

            vq = build_tiny_vq(root / "vq", seed=args.seed)
        shards = make_input(root, args.num_samples, args.seed)
        n = args.num_samples
        print(f"{n} images at {args.image_area} pixels, VQ {vq}, {args.num_cpus} CPUs", flush=True)
        base = run_baseline(shards, vq, args.image_area, args.num_cpus, root / "baseline_codes.json")
        ours = run_ours(shards, vq, args.image_area, args.num_cpus, root / "tokens")
        if base["images"] != n or ours["images"] != n:
            raise RuntimeError(f"expected {n} images, baseline {base['images']}, ours {ours['images']}")
        differ = compare_codes(root / "baseline_codes.json", root / "tokens")
        per_core = lambda s: n / s / args.num_cpus  # noqa: E731
        print(f"{'':<28}{'baseline':>12}{'ours':>12}")
        rows = [
            ("wall (s)", base["wall_s"], ours["wall_s"]),
            ("end to end (s)", base["e2e_s"], ours["e2e_s"]),
            ("images/s/core (wall)", per_core(base["wall_s"]), per_core(ours["wall_s"])),
            ("images/s/core (e2e)", per_core(base["e2e_s"]), per_core(ours["e2e_s"])),
            ("peak RSS (MB)", base["peak_rss_mb"], ours["peak_rss_mb"]),
        ]
        for label, b, o in rows:
            print(f"{label:<28}{b:>12.2f}{o:>12.2f}")
        print(f"ours phases: {ours['phases']}; grids differing from the baseline: {differ} of {n}")
        if differ:
            print("ERROR: token grids differ from transformers' processor + VQ", file=sys.stderr)
            return 1
        for name, key in (("tokenize_images", "wall_s"), ("tokenize_images_e2e", "e2e_s")):
            b, o = per_core(base[key]), per_core(ours[key])
            print(f"BENCH {name} baseline={b:.3f} ours={o:.3f} unit=images/s/core ratio={o / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
