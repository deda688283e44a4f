"""Per-sample measurements and the dataset summary behind `mmdata inspect` and the notebook.

Everything that costs GPU time later is counted here the way the loader will count it: image
tokens from the anyres shape arithmetic of `mmdata.energon_loaders.llava_ov.anyres` applied to the
image *header* sizes (no pixels decoded), text tokens and loss tokens from the loader's own
`ChatTokenizer`. So what inspect reports is what training will see, not an approximation.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from mmdata.packing.balance import DEFAULT_TILE_TOKENS, StepShape
from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer, ConversationError, with_video_placeholder
from mmdata.media_layout.media import DEFAULT_MAX_FRAMES
from mmdata.energon_loaders.video import probe_video
from mmdata.inspect.dataset import Dataset, ShardSample, load_quarantine, open_dataset, random_samples, iter_samples
from mmdata.inspect.global_reads import global_order_reads
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.inspect.packing import (
    PackingEstimate,
    estimate_packing,
    length_index_balance,
    length_index_packing,
    plan_files,
)
from mmdata.shard_format import IMAGE_PLACEHOLDER, MODALITIES, VIDEO_PLACEHOLDER, modality_of

SCHEMA = "mmdata.inspect/5"
LANGUAGES = ("zh", "en", "other")
DEFAULT_CONTEXT_LENGTHS = (4096, 8192, 16384, 32768)
#: the step shape the vision balance simulates by default: 8 DP ranks, 2 micro-batches of 2 rows each
DEFAULT_STEP_SHAPE = StepShape(dp=8, micro_batch_size=2, global_batch_size=32)


# ----------------------------------------------------------------------------- per sample


@dataclass
class ImageStats:
    name: str
    format: str | None  # PIL format from the header ("JPEG", "PNG", ...), None if unreadable
    width: int
    height: int
    tiles: int  # vision-tower tiles this image becomes (base + grid, or 1 in multi-image)
    tokens: int  # LLM positions it expands to
    grid: tuple[int, int]  # anyres grid (rows, cols); (0, 0) for base-only images

    @property
    def aspect_ratio(self) -> float:
        return self.width / self.height if self.height else float("nan")


@dataclass
class SampleStats:
    key: str
    id: str
    source: str
    shard: str
    modality: str  # one of MODALITIES
    images: list[ImageStats]
    video_tokens: int
    turns: int  # conversation turns (system turns excluded)
    language: str  # one of LANGUAGES
    text_chars: int
    text_tokens: int | None  # None without a tokenizer
    loss_tokens: int | None
    error: str | None = None  # why the loader would skip this sample (its skip reason), else None

    @property
    def image_tokens(self) -> int:
        return sum(i.tokens for i in self.images) + self.video_tokens

    @property
    def total_tokens(self) -> int | None:
        return None if self.text_tokens is None else self.text_tokens + self.image_tokens


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2A6DF or 0xF900 <= o <= 0xFAFF


def detect_language(text: str) -> str:
    """zh / en / other from letter counts: CJK ideographs >= 30% of letters -> zh, else ASCII
    letters >= 50% -> en, else other. Crude on purpose; it separates the Chinese and English
    halves of a bilingual mix, which is what a data mix review needs."""
    letters = cjk = ascii_letters = 0
    for ch in text:
        if _is_cjk(ch):
            cjk += 1
            letters += 1
        elif ch.isalpha():
            letters += 1
            ascii_letters += ch.isascii()
    if letters == 0:
        return "other"
    if cjk / letters >= 0.3:
        return "zh"
    return "en" if ascii_letters / letters >= 0.5 else "other"


def _header_size(sample: ShardSample, name: str) -> tuple[str | None, int, int]:
    """(format, width, height) from the image header only."""
    with sample.members[name].open() as f:
        with Image.open(f) as img:
            return img.format, int(img.width), int(img.height)


def image_stats(sample: ShardSample, max_tiles: int = anyres.DEFAULT_MAX_TILES) -> list[ImageStats]:
    """Sizes from headers; tiles/tokens as the LLaVA-OV loader lays them out: one image ->
    anyres (base tile + grid), several images -> one base tile each."""
    names = sample.image_names
    out: list[ImageStats] = []
    for name in names:
        fmt, w, h = _header_size(sample, name)
        (rows, cols), tokens = anyres.image_layout(h, w, len(names) == 1, max_tiles=max_tiles)
        out.append(ImageStats(name, fmt, w, h, 1 + rows * cols, tokens, (rows, cols)))
    return out


def _video_frames(sample: ShardSample, max_frames: int) -> int:
    """Frames the loader samples from the clip (its own probe: container frame count, capped)."""
    return len(probe_video(sample.media_bytes(sample.video_name), max_frames).frame_indices)


def measure_sample(
    sample: ShardSample,
    chat: Any | None = None,
    *,
    max_tiles: int = anyres.DEFAULT_MAX_TILES,
    max_frames: int | None = None,
) -> SampleStats:
    """All numbers of one sample; `chat` is a `ChatTokenizer` (text tokens need one)."""
    error = None
    try:
        images = image_stats(sample, max_tiles)
    except Exception:  # noqa: BLE001 - bit rot after preprocessing: the loader skips it as image_decode
        images, error = [], "image_decode"
    has_video = sample.video_name is not None and sample.video_name in sample.members
    conv = sample.conversations
    video_tokens = 0
    if has_video:
        try:
            video_tokens = anyres.num_video_tokens(_video_frames(sample, max_frames or DEFAULT_MAX_FRAMES))
        except Exception:  # noqa: BLE001 - the loader skips such samples as video_decode
            error = error or "video_decode"
        conv = with_video_placeholder(conv)  # as the loader does for a clip without `<video>`
    text = "\n".join(str(t.get("value", "")) for t in conv)
    plain = text.replace(IMAGE_PLACEHOLDER, " ").replace(VIDEO_PLACEHOLDER, " ")
    text_tokens = loss_tokens = None
    if chat is not None and error is None:
        try:
            toks = chat.tokenize(conv, [i.tokens for i in images], [video_tokens] if has_video else [])
            media = sum(n for _, _, n in toks.media_spans)
            text_tokens = len(toks) - media
            loss_tokens = int((toks.labels != -100).sum())
            if loss_tokens == 0:  # the loader skips samples that train nothing
                error = "no_assistant_tokens"
        except ConversationError as e:
            error = e.reason
    return SampleStats(
        key=sample.key,
        id=sample.id,
        source=sample.source,
        shard=sample.shard,
        modality=modality_of(len(sample.image_names), has_video),
        images=images,
        video_tokens=video_tokens,
        turns=sum(1 for t in conv if str(t.get("from", "")).lower() != "system"),
        language=detect_language(unicodedata.normalize("NFC", plain)),
        text_chars=len(plain),
        text_tokens=text_tokens,
        loss_tokens=loss_tokens,
        error=error,
    )


def load_chat_tokenizer(path: str | Path, what: str = "tokenizer"):
    """The loader's `ChatTokenizer` over a local HF tokenizer folder (UserError naming `what`
    when there is none; nothing is downloaded)."""
    return ChatTokenizer(load_local_tokenizer(path, what))


# ----------------------------------------------------------------------------- summary


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max (None when empty)."""
    if len(values) == 0:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    q = np.percentile(a, [50, 90, 99])

    def num(x: float) -> float | int:
        return int(x) if float(x).is_integer() else round(float(x), 4)

    return {
        "count": int(a.size),
        "mean": round(float(a.mean()), 4),
        "min": num(a.min()),
        "p50": num(q[0]),
        "p90": num(q[1]),
        "p99": num(q[2]),
        "max": num(a.max()),
    }


def _counts(keys: Sequence[str], order: Sequence[str] = ()) -> dict[str, int]:
    c = Counter(keys)
    out = {k: c.get(k, 0) for k in order}
    out.update({k: v for k, v in sorted(c.items()) if k not in out})
    return out


def _shares(counts: dict[str, int]) -> dict[str, dict[str, float | int]]:
    total = sum(counts.values())
    return {k: {"count": v, "share": round(v / total, 4) if total else 0.0} for k, v in counts.items()}


@dataclass
class DatasetSummary:
    """What `mmdata inspect` reports. `to_dict()` is the documented `--json` output."""

    root: str
    total_samples: int
    num_shards: int
    total_bytes: int
    manifest_present: bool
    sources: dict[str, int]  # samples per source
    sources_from: str  # "manifest" (exact) or "sample" (estimated from the sampled records)
    quarantine: dict[str, int]  # reason -> count
    preprocess: dict[str, Any] | None  # what the job counted besides sources (manifest counts), None without one
    length_index: dict[str, Any] | None  # plan vs online packing from lengths.parquet, None without one
    sample_seed: int
    sampled_all: bool
    tokenizer: str | None
    context_lengths: tuple[int, ...]
    samples: list[SampleStats] = field(default_factory=list)
    cp: int = 1  # the parallel sizes the packing report counts CP padding for
    tp: int = 1
    vision_balance: dict[str, Any] | None = None  # length_index_balance: DP ranks simulated, None without an index
    plan_files: list[dict[str, Any]] = field(default_factory=list)  # every pack-plan-<N>.parquet, own geometry
    global_reads: dict[str, Any] | None = None  # global_order_reads: bytes per DP rank per step, None without index

    # -- derived views (the notebook plots these) -------------------------------------------

    @property
    def images(self) -> list[ImageStats]:
        return [i for s in self.samples for i in s.images]

    def packing(self) -> dict[int, PackingEstimate] | None:
        """Packing estimates per context length (None without a tokenizer); computed once."""
        if "_packing" not in self.__dict__:
            lengths = [s.total_tokens for s in self.samples if s.total_tokens is not None and s.error is None]
            self.__dict__["_packing"] = (
                {c: estimate_packing(lengths, c, cp=self.cp, tp=self.tp) for c in self.context_lengths}
                if lengths
                else None
            )
        return self.__dict__["_packing"]

    def to_dict(self) -> dict[str, Any]:
        s = self.samples
        imgs = self.images
        tokenized = [x for x in s if x.text_tokens is not None and x.error is None]
        packing = self.packing()
        return {
            "schema": SCHEMA,
            "dataset": self.root,
            "manifest": self.manifest_present,
            "samples": self.total_samples,
            "shards": self.num_shards,
            "bytes": self.total_bytes,
            "sources": _shares(self.sources),
            "sources_from": self.sources_from,
            "quarantine": {"total": sum(self.quarantine.values()), "reasons": dict(self.quarantine)},
            "preprocess": self.preprocess,
            "length_index": self.length_index,
            "vision_balance": self.vision_balance,
            "plan_files": self.plan_files,
            "global_reads": self.global_reads,
            "sampled": {"count": len(s), "all": self.sampled_all, "seed": self.sample_seed},
            "modality": _shares(_counts([x.modality for x in s], MODALITIES)),
            "languages": _shares(_counts([x.language for x in s], LANGUAGES)),
            "turns_per_sample": distribution([x.turns for x in s]),
            "images": {
                "count": len(imgs),
                "formats": _counts([i.format or "unknown" for i in imgs]),
                "width": distribution([i.width for i in imgs]),
                "height": distribution([i.height for i in imgs]),
                "aspect_ratio": distribution([i.aspect_ratio for i in imgs]),
                "tiles_per_image": distribution([i.tiles for i in imgs]),
                "anyres_grids": _counts([f"{i.grid[0]}x{i.grid[1]}" for i in imgs if i.grid != (0, 0)]),
            },
            "image_tokens_per_sample": distribution([x.image_tokens for x in s]),
            "tokenizer": self.tokenizer,
            "text_tokens_per_sample": distribution([x.text_tokens for x in tokenized]) if self.tokenizer else None,
            "loss_tokens_per_sample": distribution([x.loss_tokens for x in tokenized]) if self.tokenizer else None,
            "total_tokens_per_sample": distribution([x.total_tokens for x in tokenized]) if self.tokenizer else None,
            "loader_skips": _counts([x.error for x in s if x.error]) if self.tokenizer else None,
            "packing": None
            if packing is None
            else {
                str(k): {
                    "efficiency": round(v.efficiency, 4),
                    "sequences": v.sequences,
                    "over_length": v.over_length,
                    "bin_fill": round(v.report.bin_fill, 4),
                    "executed_token_efficiency": round(v.report.executed_token_efficiency, 4),
                }
                for k, v in packing.items()
            },
        }


#: manifest `counts` keys shown by inspect (shard_job/manifest.py `Counts`), when present
PREPROCESS_COUNT_KEYS = ("media_resolution", "filtered", "by_filter", "duplicates", "mixed_out", "repeated")


def _manifest_preprocess(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the job counted besides sources and quarantine, and its curation settings."""
    counts = (manifest or {}).get("counts")
    if counts is None:
        return None
    out = {k: counts[k] for k in PREPROCESS_COUNT_KEYS if k in counts}
    if manifest.get("curation"):
        out["curation"] = manifest["curation"]
    return out


def _manifest_sources(manifest: dict[str, Any] | None) -> dict[str, int] | None:
    """Written samples per source from the manifest's counts (shard_job/manifest.py `Counts`)."""
    by_source = (manifest or {}).get("counts", {}).get("by_source")
    if not by_source:
        return None
    return {name: c["written"] for name, c in sorted(by_source.items())}


def summarize(
    root: str | Path,
    *,
    sample: int = 1000,
    seed: int = 0,
    all: bool = False,  # noqa: A002 - mirrors the --all flag
    tokenizer: str | Path | Any | None = None,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    max_tiles: int = anyres.DEFAULT_MAX_TILES,
    cp: int = 1,
    tp: int = 1,
    step_shape: StepShape = DEFAULT_STEP_SHAPE,
    tile_tokens: float = DEFAULT_TILE_TOKENS,
) -> DatasetSummary:
    """Summarise a shards dir from its manifest, quarantine and `sample` random samples (all
    samples with `all=True`). `tokenizer` is an HF tokenizer dir or a `ChatTokenizer`; `cp`/`tp`
    are the parallel sizes the packing report counts CP padding for; `step_shape` and
    `tile_tokens` what the vision balance simulates."""
    ds: Dataset = open_dataset(root)
    chat = load_chat_tokenizer(tokenizer, "--tokenizer") if isinstance(tokenizer, (str, Path)) else tokenizer
    samples = list(iter_samples(ds)) if all else random_samples(ds, sample, seed)
    stats = [measure_sample(x, chat, max_tiles=max_tiles) for x in samples]
    sources = _manifest_sources(ds.manifest)
    sources_from = "manifest"
    if sources is None:
        sources_from = "all" if all or len(samples) >= ds.total_samples else "sample"
        sources = _counts([x.source for x in stats])
    quarantine = _counts([q.reason for q in load_quarantine(ds.root)])
    plans: dict = {}  # the length index's plans, made once for both reports
    length_index = length_index_packing(ds.root, context_lengths, cp, tp, plans=plans)
    return DatasetSummary(
        root=str(ds.root),
        total_samples=ds.total_samples,
        num_shards=len(ds.shards),
        total_bytes=ds.total_bytes,
        manifest_present=ds.manifest is not None,
        sources=sources,
        sources_from=sources_from,
        quarantine=quarantine,
        preprocess=_manifest_preprocess(ds.manifest),
        length_index=length_index,
        sample_seed=seed,
        sampled_all=all or len(samples) >= ds.total_samples,
        tokenizer=None
        if chat is None
        else str(tokenizer)
        if isinstance(tokenizer, (str, Path))
        else type(chat).__name__,
        context_lengths=tuple(int(c) for c in context_lengths),
        samples=stats,
        cp=cp,
        tp=tp,
        vision_balance=length_index_balance(ds.root, context_lengths, step_shape, tile_tokens, plans=plans),
        plan_files=plan_files(ds.root, cp, tp),
        global_reads=global_order_reads(ds.root, context_lengths, step_shape, tile_tokens),
    )
