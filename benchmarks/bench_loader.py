"""Loader throughput: plain webdataset + transformers' LlavaOnevisionProcessor vs our energon loader.

Same shards, same worker count, same tiles (checked on a subset: max abs diff <= 1e-5).
Baseline: `webdataset.WebDataset` over the tars (torch DataLoader workers), per sample the
ChatML prompt and `LlavaOnevisionProcessor(images=..., text=...)` (tiling + `<image>` expansion
+ tokenization). Ours: `build_llava_ov_loader` (anyres + chat + loss mask + packing at 8K).
Each side is timed from building its loader until it has delivered twice as many samples as
the shard set holds (start-up included: worker spawn, tokenizer load, our packing-buffer fill).

Prints wall-clock samples/s and tiles/s for both, samples per CPU-second (main process + its
workers: the "per core" figure, robust on a shared machine), the packing efficiency at
4K/8K/16K (selection as the loader does it, over the same shards) and ends with one line:
BENCH loader baseline=<x> ours=<y> unit=samples/s ratio=<ours/baseline>   (per core)

Cores per GPU (issue 47): what a user needs to know is whether the loader keeps a GPU fed.
- demand: the samples/s one H100 consumes at 45% MFU training Aquila-VL-2B (recipes/aquila-vl-2b
  .yaml) at 8K on this mix: 0.45 x 989 TFLOPS (bf16 dense, mmtrain/models/hardware.py) over the
  mix's mean model FLOPs per sample (mmtrain/models/flops.py `step_flops` on each sample's own
  packed segment, min(tokens, 8192), and its anyres tiles; its freeze set's passes). Printed for
  stage 1 (projector only: fewest FLOPs per sample, so the most samples/s) and stage 2a+
  (everything trains); the BENCH line takes the larger demand.
- supply: each side's samples per CPU-second (decode, anyres, chat template, packing).
- `BENCH loader_cores_per_gpu baseline=<HF's cores/GPU> ours=<ours> unit=cores/GPU
  ratio=<baseline/ours>` (target: ours <= 0.5).
And the JPEG decode alone on the mix's JPEGs: Pillow's `load()` + RGB against the loader's
`_decode_image` (libjpeg-turbo directly where bit-exact, tests/test_loader_jpeg.py).

Images: photo-like (crops of real photos, `mmdata synth`'s default) unless `--synthetic`
(gradients, which decode several times faster).

  python -m benchmarks.bench_loader [--quick] [--num-samples 256] [--workers 1] [--shards DIR] [--synthetic]

`--quick` (a smoke run): 16 samples, so 32 timed per side.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mmdata.dev.shards import DevSample, write_dev_shards
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.llava_ov.task_encoder import _decode_image
from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER, packing_efficiency
from mmdata.media_layout import jpeg
from mmdata.packing.knapsack import largest_first_knapsack
from mmtrain.config.load import load_recipe
from mmtrain.llava_ov.spec import LLAVA_OV, PARTS
from mmtrain.models.flops import step_flops
from mmtrain.models.hardware import peak_tflops

REPO = Path(__file__).resolve().parents[1]
TARGET_MFU = 0.45
TARGET_CORES_PER_GPU = 0.5


def make_shards(out: Path, num_samples: int, seed: int, synthetic: bool = False) -> Path:
    """The Infinity-MM mix (mmdata synth's generator: photo-like images unless `synthetic`)
    written as loader shards."""
    from mmdata.dev.synth import generate_records

    samples = []
    for rec in generate_records(num_samples, seed=seed, synthetic=synthetic):
        conv = [dict(t) for t in rec.record["conversations"]]
        missing = len(rec.images) - sum(t["value"].count("<image>") for t in conv)
        if missing > 0:  # what preprocess does when the source has no literal placeholder
            conv[0]["value"] = "<image>\n" * missing + conv[0]["value"]
        samples.append(
            DevSample(rec.record["id"], conv, [(im.name_ext, im.data) for im in rec.images], source=rec.subset)
        )
    return write_dev_shards(out, samples, samples_per_shard=32)


class _HFProcessor:
    """transformers' LlavaOnevisionProcessor built offline (torchvision-free: no video processor)."""

    def __init__(self, tok_dir: Path):
        from transformers import AutoTokenizer, LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

        class _Proc(LlavaOnevisionProcessor):
            def check_argument_for_proper_class(self, name, arg):
                if name == "video_processor" and arg is None:
                    return None
                return super().check_argument_for_proper_class(name, arg)

        self.proc = _Proc(
            image_processor=LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3),
            tokenizer=AutoTokenizer.from_pretrained(tok_dir),
            video_processor=None,
            num_image_tokens=729,
            vision_feature_select_strategy="full",
        )
        self.chat = ChatTokenizer(self.proc.tokenizer)


def _baseline_dataset(shard_dir: Path, tok_dir: Path):
    import webdataset as wds
    from PIL import Image

    hf = _HFProcessor(tok_dir)

    def process(sample: dict) -> dict:
        record = json.loads(sample["json"])
        images = [Image.open(io.BytesIO(sample[name])) for name in record["images"]]
        text = hf.chat.render(record["conversations"])
        if images:
            out = hf.proc(images=[images], text=[text], return_tensors="pt")
            tiles = int(out["pixel_values"].shape[1]) * (1 if len(images) == 1 else len(images))
        else:
            out = hf.proc(text=[text], return_tensors="pt")
            tiles = 0
        # hand the model inputs to the main process, as a training loader must
        return {"tiles": tiles, "input_ids": out["input_ids"], "pixel_values": out.get("pixel_values")}

    urls = sorted(str(p) for p in shard_dir.glob("*.tar"))
    dataset = wds.WebDataset(
        urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker, empty_check=False
    )
    return dataset.repeat().map(process)  # epochs repeat, as a training loader's do


def _cpu_seconds() -> float:
    """CPU time of this process plus its reaped children (the DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class Run:
    samples: int
    tiles: int
    wall_s: float
    cpu_s: float
    packing_efficiency: float = 0.0

    @property
    def per_core(self) -> float:
        """samples per CPU-second over the main process and all its workers."""
        return self.samples / self.cpu_s


def _measure(make_iter, count) -> Run:
    gc.collect()
    c0, t0 = _cpu_seconds(), time.perf_counter()
    n = tiles = 0
    extra: dict = {}
    it = make_iter(extra)
    for samples, t in it:
        n += samples
        tiles += t
        if n >= count:
            break
    wall = time.perf_counter() - t0
    del it
    extra.clear()
    gc.collect()  # shuts the workers down, so their CPU time is in RUSAGE_CHILDREN
    time.sleep(0.5)
    return Run(n, tiles, wall, _cpu_seconds() - c0)


def run_baseline(shard_dir: Path, tok_dir: Path, workers: int, max_samples: int) -> Run:
    def make(extra):
        loader = torch.utils.data.DataLoader(
            _baseline_dataset(shard_dir, tok_dir), batch_size=None, num_workers=workers
        )
        extra["loader"] = loader
        return ((1, item["tiles"]) for item in loader)

    return _measure(make, max_samples)


def run_ours(shard_dir: Path, tok_dir: Path, workers: int, max_samples: int, seq_length: int, **options) -> Run:
    """Our loader's run (`options`: more of its arguments, e.g. bench_global_throughput's global order)."""
    stats = {}

    def make(extra):
        loader = build_llava_ov_loader(
            shard_dir,
            tok_dir,
            seq_length=seq_length,
            micro_batch_size=1,
            num_workers=workers,
            packing=True,
            seed=0,
            **options,
        )
        extra["loader"] = loader
        stats["loader_stats"] = loader.stats
        return ((sum(len(r) for r in b.sample_ids), int(b.pixel_values.shape[0])) for b in loader)

    run = _measure(make, max_samples)
    run.packing_efficiency = stats["loader_stats"].packing_efficiency
    return run


def check_identical_tiles(shard_dir: Path, tok_dir: Path, count: int = 6) -> float:
    """Max |ours - HF| over the first single-image samples' tiles."""
    import webdataset as wds
    from PIL import Image

    hf = _HFProcessor(tok_dir)
    worst, seen = 0.0, 0
    for sample in wds.WebDataset(
        sorted(str(p) for p in shard_dir.glob("*.tar")), shardshuffle=False, empty_check=False
    ):
        record = json.loads(sample["json"])
        if len(record["images"]) != 1:
            continue
        image = Image.open(io.BytesIO(sample[record["images"][0]]))
        ref = hf.proc.image_processor(image, return_tensors="pt")["pixel_values"][0]
        ours = anyres.process_image(image)
        worst = max(worst, float((ours.pixel_values - ref).abs().max()))
        seen += 1
        if seen >= count:
            break
    return worst


def _shard_samples(shard_dir: Path):
    import webdataset as wds

    yield from wds.WebDataset(sorted(str(p) for p in shard_dir.glob("*.tar")), shardshuffle=False, empty_check=False)


def sample_shapes(shard_dir: Path, tok_dir: Path) -> list[tuple[int, int]]:
    """(LLM tokens, vision tiles) of every sample as the loader lays it out."""
    from PIL import Image
    from transformers import AutoTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tok_dir))
    out = []
    for sample in _shard_samples(shard_dir):
        record = json.loads(sample["json"])
        sizes = []
        for name in record["images"]:
            with Image.open(io.BytesIO(sample[name])) as im:
                sizes.append((im.height, im.width))
        layouts = [anyres.image_layout(h, w, len(sizes) == 1) for h, w in sizes]
        tiles = sum(1 + g[0] * g[1] for g, _ in layouts)
        out.append((len(chat.tokenize(record["conversations"], [n for _, n in layouts])), tiles))
    return out


def packing_report(shapes: list[tuple[int, int]], lengths_for: tuple[int, ...]) -> dict[int, float]:
    """Efficiency of the loader's pack selection over the samples' token lengths."""
    lengths = [n for n, _ in shapes]
    out = {}
    for seq in lengths_for:
        bins = []
        for start in range(0, len(lengths), DEFAULT_PACKING_BUFFER):
            chunk = [min(x, seq) for x in lengths[start : start + DEFAULT_PACKING_BUFFER]]
            bins += [[chunk[i] for i in b] for b in largest_first_knapsack(chunk, seq)]
        out[seq] = packing_efficiency(bins, seq)
    return out


@dataclass
class GpuDemand:
    stage: str
    flops_per_sample: float  # model FLOPs (the MFU's numerator) per sample, mean over the mix
    samples_per_s: float  # what one GPU consumes at TARGET_MFU


def gpu_demand(shapes: list[tuple[int, int]], seq_length: int, stage: str) -> GpuDemand:
    """Samples/s one H100 trains at TARGET_MFU on Aquila-VL-2B (its recipe at `stage`) over these
    samples: each its own packed segment of min(tokens, seq_length) positions with its tiles."""
    recipe = load_recipe(REPO / "recipes" / "aquila-vl-2b.yaml", [f"stage={stage}"])
    model = LLAVA_OV.model_shapes(recipe.model)
    trainable = [p for p in PARTS if p not in recipe.freeze]
    total = sum(
        step_flops(model, [[0, min(n, seq_length)]], tiles, trainable, samples=[[1]]).total for n, tiles in shapes
    )
    per_sample = total / len(shapes)
    peak = peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    return GpuDemand(stage, per_sample, TARGET_MFU * peak * 1e12 / per_sample)


def jpeg_decode_speed(shard_dir: Path, repeats: int = 3) -> tuple[int, int, float, float]:
    """(JPEGs, of them taking the direct decode, Pillow s, loader s): the mix's JPEGs decoded to
    RGB by Pillow (`load()`, then RGB as anyres does) and by the loader's `_decode_image`; best of
    `repeats` passes each (CPU time)."""
    from PIL import Image

    files = [v for s in _shard_samples(shard_dir) for k, v in s.items() if k.endswith((".jpg", ".jpeg"))]

    def pillow(data: bytes) -> None:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # (to_rgb alone leaves an RGB image undecoded)
            anyres.to_rgb(im)

    def loader(data: bytes) -> None:
        with _decode_image(data) as im:
            anyres.to_rgb(im)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            c0 = time.process_time()
            for data in files:
                fn(data)
            times.append(time.process_time() - c0)
        return min(times)

    direct = sum(jpeg.decode_rgb_exact(d) is not None for d in files)
    return len(files), direct, best(pillow), best(loader)


def _count_samples(shard_dir: Path) -> int:
    info = json.loads((shard_dir / ".nv-meta" / ".info.json").read_text())
    return int(sum(info["shard_counts"].values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, help="existing shard dir (default: write the synthetic mix)")
    parser.add_argument("--num-samples", type=int, default=256, help="synthetic samples to write")
    parser.add_argument("--measure", type=int, default=0, help="samples timed per side (default: 2 passes)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 samples (32 timed per side)")
    parser.add_argument("--synthetic", action="store_true", help="gradient images instead of photo-like")
    args = parser.parse_args()
    if args.quick:
        args.num_samples = 16
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tok_dir = build_tiny_qwen2_tokenizer(tmp_path / "tok")
        shard_dir = args.shards or make_shards(tmp_path / "shards", args.num_samples, args.seed, args.synthetic)
        diff = check_identical_tiles(shard_dir, tok_dir)
        print(f"identical tiles check: max |ours - HF| = {diff:.2e} (<= 1e-5 required)")
        assert diff <= 1e-5
        measure = args.measure or 2 * _count_samples(shard_dir)
        base = run_baseline(shard_dir, tok_dir, args.workers, measure)
        ours = run_ours(shard_dir, tok_dir, args.workers, measure, 8192)
        shapes = sample_shapes(shard_dir, tok_dir)
        effs = packing_report(shapes, (4096, 8192, 16384))
        decode = jpeg_decode_speed(shard_dir)
        demands = [gpu_demand(shapes, 8192, stage) for stage in ("1", "2a")]

    print(f"workers per side: {args.workers} (torch threads 1)")
    head = (
        f"{'':10s} {'samples':>8s} {'wall s':>8s} {'cpu s':>8s} "
        f"{'samples/s':>10s} {'tiles/s':>9s} {'samples/cpu-s':>14s}"
    )
    print(head)
    for name, r in (("baseline", base), ("ours", ours)):
        print(
            f"{name:10s} {r.samples:8d} {r.wall_s:8.1f} {r.cpu_s:8.1f} {r.samples / r.wall_s:10.2f} "
            f"{r.tiles / r.wall_s:9.2f} {r.per_core:14.2f}"
        )
    print(
        f"wall-clock ratio (ours/baseline samples/s): {(ours.samples / ours.wall_s) / (base.samples / base.wall_s):.3f}"
    )
    print(f"packing efficiency measured by the loader at 8K: {ours.packing_efficiency:.4f}")
    for seq, eff in effs.items():
        print(f"packing efficiency (selection, buffer {DEFAULT_PACKING_BUFFER}) at {seq // 1024}K: {eff:.4f}")
    files, direct, pillow_s, loader_s = decode
    if files:
        print(
            f"JPEG decode to RGB, {files} JPEGs of the mix ({direct} decoded by libjpeg-turbo directly, bit-exact; "
            f"the rest by Pillow): Pillow {pillow_s / files * 1e3:.2f} ms, the loader {loader_s / files * 1e3:.2f} ms "
            f"per image (CPU, best of 3): {pillow_s / loader_s:.2f}x"
        )
    tokens = sum(n for n, _ in shapes) / len(shapes)
    tiles = sum(t for _, t in shapes) / len(shapes)
    print(
        f"the mix: {len(shapes)} samples, {'gradient' if args.synthetic else 'photo-like'} images, "
        f"{tokens:,.0f} LLM tokens and {tiles:.2f} tiles per sample on average (before the 8K cut)"
    )
    for d in demands:
        print(
            f"GPU demand, Aquila-VL-2B stage {d.stage} at 8K: {d.flops_per_sample / 1e12:.2f} TFLOPs per sample; "
            f"one H100 at {TARGET_MFU:.0%} MFU of 989 TFLOPS bf16 consumes {d.samples_per_s:.1f} samples/s"
        )
    demand = max(demands, key=lambda d: d.samples_per_s)
    cores = {name: demand.samples_per_s / r.per_core for name, r in (("baseline", base), ("ours", ours))}
    print(
        f"loader_cores_per_gpu: {demand.samples_per_s:.1f} samples/s per GPU (stage {demand.stage}) / "
        f"{ours.per_core:.2f} samples per CPU-second = {cores['ours']:.2f} cores per GPU "
        f"(target <= {TARGET_CORES_PER_GPU}; HF's processor: {cores['baseline']:.2f})"
    )
    print("BENCH line: samples/s per core = samples per CPU-second of the main process + its workers")
    print(
        f"BENCH loader baseline={base.per_core:.3f} ours={ours.per_core:.3f} unit=samples/s "
        f"ratio={ours.per_core / base.per_core:.3f}"
    )
    print(
        f"BENCH loader_cores_per_gpu baseline={cores['baseline']:.3f} ours={cores['ours']:.3f} unit=cores/GPU "
        f"ratio={cores['baseline'] / cores['ours']:.3f}"
    )


if __name__ == "__main__":
    main()
