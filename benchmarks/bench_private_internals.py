"""What the preprocessing job's two library-layout fast paths still buy (issue 31).

1. The WebP check (`mmdata/preprocess/decode_check.check_webp`) sets libwebp decoder options the
   `webp` binding does not name (no loop filter, no fancy upsampling, a crop of the bottom rows)
   through the binding's struct layout, behind `require_tested_webp()`. Compared per image on
   photo-like pictures (a real photo when matplotlib's sample data is installed, else textured
   noise) with what the public names alone give: libwebp's default decoder options decoding the
   whole frame to YUV(A), and Pillow's `Image.open(...).load()`.
2. Shard writes (`mmdata/shard_job/direct_io.SequentialFile`): O_DIRECT from one reused aligned
   buffer against buffered writes with `posix_fadvise(DONTNEED)` after each shard's fsync, and
   plain buffered writes. Each variant writes the same shards (incompressible bytes, like media)
   into fresh files, in alternating order per round; per variant: wall time, the writing
   thread's CPU time (user + system), and how much of the shards is still in the page cache
   afterwards (mincore): pages that evict the inputs the job is reading.

    .venv/bin/python -m benchmarks.bench_private_internals [--quick] [--shards 8]
        [--shard-mib 256] [--repeats 3] [--workdir DIR]

Prints per-variant figures and peak RSS, then `BENCH webp_check baseline=<public µs> ours=<gated
µs> unit=us ratio=<public/gated>` and `BENCH direct_io baseline=<fadvise MB/s> ours=<O_DIRECT
MB/s> unit=MB/s ratio=<O_DIRECT/fadvise>` (throughput per writing-thread CPU-second).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import webp
from PIL import Image

from mmdata.preprocess import decode_check
from mmdata.shard_job.direct_io import ALIGN, SequentialFile, mount_fstype

VARIANTS = ("direct", "fadvise", "buffered")  # SequentialFile(direct=..., drop_cache=...)


def peak_rss_mib() -> float:
    """This process's own peak RSS (VmHWM; ru_maxrss off Linux)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:"))) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def photo(size: tuple[int, int], seed: int) -> Image.Image:
    """A photo-like RGB picture of `size`: a random crop of a real photo when one is installed,
    else smooth colour fields with fine texture (JPEG/WebP sizes near a photo's)."""
    rng = np.random.default_rng(seed)
    try:
        from matplotlib import cbook

        with cbook.get_sample_data("grace_hopper.jpg") as f:
            src = Image.open(f).convert("RGB")
        w, h = src.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        return src.crop((x, y, x + cw, y + ch)).resize(size, Image.Resampling.BICUBIC)
    except (ImportError, OSError, ValueError):
        coarse = rng.integers(0, 256, (size[1] // 32 + 1, size[0] // 32 + 1, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
        noise = rng.normal(0, 18, base.shape)
        return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def webp_public_default(data: bytes, has_alpha: bool) -> None:
    """The same check through named options only: libwebp's defaults, the whole frame to YUV(A)."""
    config = webp.WebPDecoderConfig.new()
    config.output.colorspace = webp.lib.MODE_YUVA if has_alpha else webp.lib.MODE_YUV
    status = webp.lib.WebPDecode(webp.ffi.from_buffer(data), len(data), config.ptr)
    webp.lib.WebPFreeDecBuffer(webp.ffi.addressof(config.ptr.output))
    if status != webp.lib.VP8_STATUS_OK:
        raise OSError(f"WebP decode failed: status {status}")


def per_call_us(fn, arg, calls: int, repeats: int) -> float:
    """CPU µs per call (this thread's CPU time: the machine's other load does not count), best of
    `repeats` after one warm-up call."""
    fn(arg)
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(calls):
            fn(arg)
        best = min(best, (time.thread_time() - t) / calls)
    return best * 1e6


def bench_webp(quick: bool) -> dict[str, float]:
    size = (320, 240) if quick else (1024, 768)
    calls, repeats = (5, 1) if quick else (30, 5)
    out: dict[str, float] = {}
    for mode in ("RGB", "RGBA"):
        im = photo(size, seed=1)
        if mode == "RGBA":
            alpha = Image.linear_gradient("L").resize(size)
            im = im.convert("RGBA")
            im.putalpha(alpha)
        buf = io.BytesIO()
        im.save(buf, "WEBP", quality=90)
        data = buf.getvalue()
        w, h, has_alpha, _ = decode_check.webp_features(data)
        gated = per_call_us(lambda d, w=w, h=h, a=has_alpha: decode_check.check_webp(d, w, h, a), data, calls, repeats)
        public = per_call_us(lambda d, a=has_alpha: webp_public_default(d, a), data, calls, repeats)
        pillow = per_call_us(lambda d: Image.open(io.BytesIO(d)).load(), data, calls, repeats)
        print(
            f"webp {mode} {size[0]}x{size[1]} ({len(data) / 1024:.0f} KiB): gated check {gated:.0f} CPU-µs, "
            f"public default options {public:.0f} µs ({public / gated:.2f}x), "
            f"Pillow load {pillow:.0f} µs ({pillow / gated:.2f}x)"
        )
        out[f"{mode}_gated"], out[f"{mode}_public"], out[f"{mode}_pillow"] = gated, public, pillow
    return out


class _Mincore:
    """Fraction of a file's pages in the page cache (Linux mincore on a read-only mapping)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def cached(self, path: Path) -> float:
        size = path.stat().st_size
        if not size:
            return 0.0
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = self.libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            pages = (size + ALIGN - 1) // ALIGN
            vec = ctypes.create_string_buffer(pages)
            rc = self.libc.mincore(addr, size, vec)
            self.libc.munmap(addr, size)
            return float("nan") if rc else sum(b & 1 for b in vec.raw) / pages
        finally:
            os.close(fd)


def write_shards(folder: Path, variant: str, payload: bytes, shards: int) -> tuple[float, float, list[Path]]:
    """(wall s, thread CPU s) to write `shards` copies of `payload` as new files, as the shard
    writer puts them (4 MiB pieces)."""
    paths = [folder / f"{variant}-{i:03d}.tar" for i in range(shards)]
    view = memoryview(payload)
    t0, c0 = time.perf_counter(), time.thread_time()
    for path in paths:
        with SequentialFile(path, direct=variant == "direct", drop_cache=variant == "fadvise") as f:
            for i in range(0, len(payload), 4 << 20):
                f.put(view[i : i + (4 << 20)])
                f.flush()
            f.finish()
    return time.perf_counter() - t0, time.thread_time() - c0, paths


def bench_writes(folder: Path, shards: int, shard_mib: int, repeats: int) -> dict[str, dict[str, float]]:
    payload = np.random.default_rng(0).integers(0, 256, (shard_mib << 20) + 1234, dtype=np.uint8).tobytes()
    mib = shards * len(payload) / (1 << 20)
    mincore = _Mincore()
    runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            wall, cpu, paths = write_shards(folder, variant, payload, shards)
            cached = statistics.fmean(mincore.cached(p) for p in paths)
            for p in paths:
                p.unlink()
            runs[variant].append((wall, cpu, cached))
    out = {}
    for variant, rows in runs.items():
        wall, cpu, cached = (statistics.median(col) for col in zip(*rows))
        out[variant] = {
            "wall": wall,
            "cpu": cpu,
            "cached": cached,
            "mb_s": mib / wall,
            "mb_cpu_s": mib / max(cpu, 1e-9),
        }
        print(
            f"write {variant:8s}: {shards} x {shard_mib} MiB in {wall:.2f} s ({mib / wall:.0f} MiB/s), "
            f"writer CPU {cpu:.2f} s ({mib / max(cpu, 1e-9):.0f} MiB per CPU-s), "
            f"{cached * 100:.0f} % of the shards left in the page cache"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: checks that it runs")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=256, help="the job's default target shard size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="where the shards go (default: a temp folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shards, args.shard_mib, args.repeats = 3, 4, 1
    folder = Path(tempfile.mkdtemp(prefix="bench-private-", dir=args.workdir))
    try:
        print(
            f"shards on {mount_fstype(folder)} ({folder}); python {sys.version.split()[0]}, webp "
            f"{metadata.version('webp')}"
        )
        wp = bench_webp(args.quick)
        writes = bench_writes(folder, args.shards, args.shard_mib, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    public, gated = (
        statistics.fmean((wp["RGB_public"], wp["RGBA_public"])),
        statistics.fmean((wp["RGB_gated"], wp["RGBA_gated"])),
    )
    print(f"BENCH webp_check baseline={public:.1f} ours={gated:.1f} unit=us ratio={public / gated:.2f}")
    base, ours = writes["fadvise"]["mb_cpu_s"], writes["direct"]["mb_cpu_s"]
    print(f"BENCH direct_io baseline={base:.1f} ours={ours:.1f} unit=MB/s ratio={ours / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
