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

  python -m benchmarks.bench_loader [--quick] [--num-samples 256] [--workers 1] [--shards DIR]

`--quick` (a smoke run): 16 synthetic samples, so 32 timed per side.
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
from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER, packing_efficiency
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.packing.knapsack import largest_first_knapsack


def make_shards(out: Path, num_samples: int, seed: int) -> Path:
    """The synthetic Infinity-MM mix (mmdata synth's generator) written as loader shards."""
    from mmdata.dev.synth import generate_records

    samples = []
    for rec in generate_records(num_samples, seed=seed, synthetic=True):
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


def run_ours(shard_dir: Path, tok_dir: Path, workers: int, max_samples: int, seq_length: int) -> Run:
    stats = {}

    def make(extra):
        loader = build_llava_ov_loader(
            shard_dir, tok_dir, seq_length=seq_length, micro_batch_size=1, num_workers=workers, packing=True, seed=0
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


def packing_report(shard_dir: Path, tok_dir: Path, lengths_for: tuple[int, ...]) -> dict[int, float]:
    """Efficiency of the loader's pack selection over the shards' token lengths."""
    import webdataset as wds
    from PIL import Image
    from transformers import AutoTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tok_dir))
    lengths = []
    for sample in wds.WebDataset(
        sorted(str(p) for p in shard_dir.glob("*.tar")), shardshuffle=False, empty_check=False
    ):
        record = json.loads(sample["json"])
        sizes = []
        for name in record["images"]:
            with Image.open(io.BytesIO(sample[name])) as im:
                sizes.append((im.height, im.width))
        counts = (
            [anyres.num_image_tokens(*sizes[0])] if len(sizes) == 1 else [anyres.num_base_only_tokens()] * len(sizes)
        )
        lengths.append(len(chat.tokenize(record["conversations"], counts)))
    out = {}
    for seq in lengths_for:
        bins = []
        for start in range(0, len(lengths), DEFAULT_PACKING_BUFFER):
            chunk = [min(x, seq) for x in lengths[start : start + DEFAULT_PACKING_BUFFER]]
            bins += [[chunk[i] for i in b] for b in largest_first_knapsack(chunk, seq)]
        out[seq] = packing_efficiency(bins, seq)
    return out


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
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 synthetic samples (32 timed per side)")
    args = parser.parse_args()
    if args.quick:
        args.num_samples = 16
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tok_dir = build_tiny_qwen2_tokenizer(tmp_path / "tok")
        shard_dir = args.shards or make_shards(tmp_path / "shards", args.num_samples, args.seed)
        diff = check_identical_tiles(shard_dir, tok_dir)
        print(f"identical tiles check: max |ours - HF| = {diff:.2e} (<= 1e-5 required)")
        assert diff <= 1e-5
        measure = args.measure or 2 * _count_samples(shard_dir)
        base = run_baseline(shard_dir, tok_dir, args.workers, measure)
        ours = run_ours(shard_dir, tok_dir, args.workers, measure, 8192)
        effs = packing_report(shard_dir, tok_dir, (4096, 8192, 16384))

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
    print("BENCH line: samples/s per core = samples per CPU-second of the main process + its workers")
    print(
        f"BENCH loader baseline={base.per_core:.3f} ours={ours.per_core:.3f} unit=samples/s "
        f"ratio={ours.per_core / base.per_core:.3f}"
    )


if __name__ == "__main__":
    main()
