"""GPU check of `mmdata tokenize-images` (run on a machine with CUDA; a few minutes at most).

1. The job with the VQ on cuda (`--device cuda`, Ray GPU resources, TokenizeWorker actors)
   finishes and records device "cuda"; its grids are compared with transformers' own
   processor + `Emu3VQVAE.encode` run on the same GPU, and with the CPU job's grids (float kernels differ between
   devices,
   so a near-tie can pick another code: the agreement is reported, and must be >= 99%).
2. The actor path: every worker loaded the VQ once (manifest `run.vq_loads` all 1) although
   each tokenized several chunks (on a GPU, Ray tasks would reload it for every chunk).
3. Determinism on GPU: 1 GPU per worker vs 4 workers sharing a GPU (--gpus-per-worker 0.25)
   and another chunking give byte-identical shards.
4. Throughput: images/s of the cuda job vs the CPU job on the same images (real-size area).

    python -m benchmarks.gpu_check_tokenize_images [--num-samples 64] [--image-area 262144]
        [--vision-tokenizer VQ_DIR]

Prints `GPU_CHECK ok` at the end when every check passed (exit 0), else exit 1. Without CUDA it
prints `GPU_CHECK skipped: ...` and exits 0 (nothing to check on this machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bench_tokenize_images import make_input, read_grids, run_baseline
from benchmarks.common import ray_job_env


def run_job(*args: str) -> None:
    cmd = [sys.executable, "-m", "mmdata.vision_tokens.cli", "--no-progress", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ray_job_env())
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")


def agreement(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys(), "different images"
    same = sum(int((a[k] == b[k]).sum()) for k in a)
    return same / sum(a[k].size for k in a)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " Checks that each TokenizeWorker actor "
        "loads the VQ once however many chunks it tokenizes; exits 0 with a skip line "
        "without CUDA."
    )
    p.add_argument("--num-samples", type=int, default=64, help="input samples (default 64)")
    p.add_argument("--image-area", type=int, default=512 * 512, help="target pixels per image (default 512x512)")
    p.add_argument(
        "--vision-tokenizer",
        type=Path,
        default=None,
        help="an Emu3 VQ dir (default: a tiny random one built by mmdata tiny-vq)",
    )
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("GPU_CHECK skipped: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_check_tokenize_") as tmp:
        root = Path(tmp)
        vq = args.vision_tokenizer
        if vq is None:
            from mmdata.dev.tiny_vq_model import build_tiny_vq

            vq = build_tiny_vq(root / "vq")
        shards = make_input(root, args.num_samples, seed=0)
        common = [str(shards), "--vision-tokenizer", str(vq), "--image-area", str(args.image_area)]
        runs = {}
        for name, extra in (
            ("cuda", ["--device", "cuda", "--chunk-samples", "8"]),
            ("cuda_shared", ["--device", "cuda", "--gpus-per-worker", "0.25", "--chunk-samples", "5"]),
            ("cpu", ["--device", "cpu"]),
        ):
            out = root / name
            run_job(*common, "--output", str(out), *extra)
            runs[name] = json.loads((out / "manifest.json").read_text())
            m = runs[name]
            r = m["run"]
            print(
                f"{name:<12} device={m['device']} images={m['counts']['tokens']['images']} "
                f"wall={m['wall_time_s']:.1f}s workers={r['workers']} chunks={r['worker_chunks']} "
                f"vq_loads={r['vq_loads']} phases={r['phases']}"
            )
            if name.startswith("cuda") and not (
                r["workers"] >= 1 and r["vq_loads"] == [1] * r["workers"] and r["chunks"] > r["workers"]
            ):
                print(f"FAIL: {name}: expected one VQ load per worker over more chunks than workers")
                ok = False
        if runs["cuda"]["device"] != "cuda":
            print("FAIL: the cuda run did not run on cuda")
            ok = False
        same_bytes = all(
            (root / "cuda" / s["name"]).read_bytes() == (root / "cuda_shared" / s["name"]).read_bytes()
            for s in runs["cuda"]["shards"]
        )
        print(f"determinism on GPU (1 GPU/worker vs 0.25, other chunks): {'identical' if same_bytes else 'DIFFERENT'}")
        ok &= same_bytes
        g_cuda, g_cpu = read_grids(root / "cuda"), read_grids(root / "cpu")
        run_baseline(shards, vq, args.image_area, 1, root / "hf_cuda.json", device="cuda")
        g_hf = {k: np.array(v) for k, v in json.loads((root / "hf_cuda.json").read_text()).items()}
        a_hf, a_cpu = agreement(g_cuda, g_hf), agreement(g_cuda, g_cpu)
        print(f"token agreement: cuda job vs HF encode on cuda {a_hf:.5f}, cuda job vs cpu job {a_cpu:.5f}")
        ok &= a_hf >= 0.99 and a_cpu >= 0.99
        n = runs["cuda"]["counts"]["tokens"]["images"]
        t_gpu = runs["cuda"]["run"]["phases"]["tokenize_s"]
        t_cpu = runs["cpu"]["run"]["phases"]["tokenize_s"]
        print(f"tokenize phase: cuda {n / t_gpu:.1f} images/s, cpu {n / t_cpu:.1f} images/s")
    print("GPU_CHECK ok" if ok else "GPU_CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
