"""`mmdata inspect` and `mmdata preview` on Emu3 VQ token shards (`mmdata tokenize-images`
output). Those shards hold code grids, not pictures: the image statistics of `inspect` (sizes,
anyres tiles) would all read zero. Their own summary is about the grids: how many per sample,
their shapes, the visual tokens they add, and how much of the VQ codebook the sample uses (a
codebook used in a few codes means a broken VQ or a wrong image area). The on-disk contract is
mmdata/energon_loaders/emu3/token_format.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from mmdata import shard_format as sf
from mmdata.energon_configs import config_sample_type
from mmdata.energon_loaders.emu3 import token_format
from mmdata.inspect.dataset import Dataset, ShardSample, load_quarantine
from mmdata.inspect.stats import _counts, _shares, distribution

#: `--json` schema of a token shard summary (docs/inspect.md)
TOKEN_SCHEMA = "mmdata.inspect.vq_tokens/1"


def is_token_dataset(root: str | Path) -> bool:
    """Whether the energon config our loaders read (`.nv-meta/mmdata.yaml`, else `dataset.yaml`)
    names the VQ token sample type (or, without one, its manifest says it was written by
    tokenize-images)."""
    root = Path(root)
    if (found := config_sample_type(root)) is not None:
        return found == ".".join(token_format.SAMPLE_TYPE)
    manifest = root / sf.MANIFEST_NAME
    if manifest.is_file():
        try:
            return json.loads(manifest.read_text()).get("tool") == "mmdata tokenize-images"
        except ValueError:
            return False
    return False


@dataclass
class GridStats:
    """One code grid of a sample, as its `vq.json` and `.npy` member describe it."""

    member: str
    source: str  # the image member it was encoded from
    rows: int
    cols: int
    pixels: tuple[int, int]  # (H, W) of the resized image the VQ saw
    codes: np.ndarray  # the distinct codes of the grid

    @property
    def tokens(self) -> int:
        return self.rows * self.cols


def sample_grids(sample: ShardSample) -> list[GridStats]:
    """The grids of one token-shard sample (read and checked against their `vq.json` entry)."""
    grids = token_format.decode_vq_json(sample.members[token_format.VQ_JSON_MEMBER].read())
    out = []
    for g in grids:
        grid = token_format.decode_grid(sample.members[g.member].read())
        if grid.shape != (g.height, g.width):
            raise ValueError(
                f"sample {sample.key}: {g.member} is {grid.shape[0]}x{grid.shape[1]}, "
                f"its vq.json says {g.height}x{g.width}"
            )
        out.append(
            GridStats(g.member, g.source, g.height, g.width, (int(g.pixels[0]), int(g.pixels[1])), np.unique(grid))
        )
    return out


def codebook_size(manifest: dict[str, Any] | None) -> int | None:
    config = ((manifest or {}).get("vision_tokenizer") or {}).get("config") or {}
    size = config.get("codebook_size")
    return int(size) if isinstance(size, int) else None


def summarize_tokens(ds: Dataset, samples: list[ShardSample], *, seed: int, sampled_all: bool) -> dict[str, Any]:
    """The `--json` summary of a token shard folder from its manifest and `samples`."""
    per_sample = [sample_grids(s) for s in samples]
    grids = [g for gs in per_sample for g in gs]
    seen = np.unique(np.concatenate([g.codes for g in grids])) if grids else np.empty(0, dtype=np.int64)
    size = codebook_size(ds.manifest)
    manifest = ds.manifest or {}
    by_source = (manifest.get("counts") or {}).get("by_source")
    sources = (
        {k: v["written"] for k, v in sorted(by_source.items())} if by_source else _counts([s.source for s in samples])
    )
    return {
        "schema": TOKEN_SCHEMA,
        "kind": "vq_tokens",
        "dataset": str(ds.root),
        "manifest": ds.manifest is not None,
        "samples": ds.total_samples,
        "shards": len(ds.shards),
        "bytes": ds.total_bytes,
        "made_from": (manifest.get("input") or {}).get("path"),
        "vision_tokenizer": (manifest.get("vision_tokenizer") or {}).get("path"),
        "image_area": manifest.get("image_area"),
        "written_counts": (manifest.get("counts") or {}).get("tokens"),
        "sources": _shares(sources),
        "sources_from": "manifest" if by_source else ("all" if sampled_all else "sample"),
        "quarantine": {"total": len(q := load_quarantine(ds.root)), "reasons": _counts([r.reason for r in q])},
        "sampled": {"count": len(samples), "all": sampled_all, "seed": seed},
        "text_only_share": round(sum(not gs for gs in per_sample) / len(samples), 4) if samples else None,
        "grids_per_sample": distribution([len(gs) for gs in per_sample]),
        "visual_tokens_per_sample": distribution([sum(g.tokens for g in gs) for gs in per_sample]),
        "grids": {
            "count": len(grids),
            "rows": distribution([g.rows for g in grids]),
            "cols": distribution([g.cols for g in grids]),
            "shapes": _counts([f"{g.rows}x{g.cols}" for g in grids]),
            "tokens_per_grid": distribution([g.tokens for g in grids]),
        },
        "codebook": {
            "size": size,
            "distinct_codes_seen": int(seen.size),
            "share_used": round(seen.size / size, 4) if size else None,
            "max_code": int(seen.max()) if seen.size else None,
        },
    }


def token_summary_tables(summary: dict[str, Any]) -> list:
    """The summary as rich tables (what `mmdata inspect DIR` prints for token shards)."""

    def dist(d: dict[str, Any]) -> str:
        if not d or d.get("count", 0) == 0:
            return "—"
        return f"min {d['min']} · median {d['p50']} · mean {d['mean']} · max {d['max']}"

    overview = Table(title=f"Emu3 VQ token shards: {summary['dataset']}", show_header=False)
    cb = summary["codebook"]
    rows = [
        ("samples", f"{summary['samples']:,} in {summary['shards']:,} shards ({summary['bytes']:,} bytes)"),
        ("made from", str(summary["made_from"] or "—")),
        ("vision tokenizer", f"{summary['vision_tokenizer'] or '—'} (image area {summary['image_area'] or '—'})"),
        (
            "sampled",
            f"{summary['sampled']['count']:,}"
            + (" (all)" if summary["sampled"]["all"] else f" (seed {summary['sampled']['seed']})"),
        ),
        ("text-only share", str(summary["text_only_share"])),
        ("grids per sample", dist(summary["grids_per_sample"])),
        ("visual tokens per sample", dist(summary["visual_tokens_per_sample"])),
        ("grid rows", dist(summary["grids"]["rows"])),
        ("grid cols", dist(summary["grids"]["cols"])),
        (
            "codebook",
            f"{cb['distinct_codes_seen']:,} distinct codes seen"
            + (f" of {cb['size']:,} ({cb['share_used']:.1%})" if cb["size"] else ""),
        ),
        ("quarantine", f"{summary['quarantine']['total']:,}"),
    ]
    for k, v in rows:
        overview.add_row(k, v)
    shapes = Table(title="grid shapes (rows x cols)", min_width=30)
    shapes.add_column("shape")
    shapes.add_column("grids", justify="right")
    for shape, n in sorted(summary["grids"]["shapes"].items(), key=lambda kv: -kv[1])[:12]:
        shapes.add_row(shape, f"{n:,}")
    sources = Table(title=f"sources ({summary['sources_from']})")
    sources.add_column("source")
    sources.add_column("samples", justify="right")
    sources.add_column("share", justify="right")
    for name, v in summary["sources"].items():
        sources.add_row(name or "—", f"{v['count']:,}", f"{v['share']:.1%}")
    return [overview, shapes, sources]


def preview_lines(sample: ShardSample, position: int | None) -> list[str]:
    """One token-shard sample for `mmdata preview`: where it is, its grids, its turns as written."""
    where = f"{sample.shard} #{sample.index}" + (f", global index {position:,}" if position is not None else "")
    grids = sample_grids(sample)
    lines = [
        f"sample {sample.key} · id {sample.id} · source {sample.source or '—'} · {where} · "
        f"{len(grids)} VQ grid{'s' if len(grids) != 1 else ''}, {sum(g.tokens for g in grids):,} visual tokens"
    ]
    for g in grids:
        lines.append(
            f"  grid {g.member} (from {g.source}, resized to {g.pixels[1]}x{g.pixels[0]} px (WxH)): "
            f"{g.rows}x{g.cols} codes = {g.tokens:,} tokens, {g.codes.size:,} distinct "
            f"(codes {int(g.codes.min())}..{int(g.codes.max())})"
        )
    for turn in sample.conversations:
        lines.append(f"{turn.get('from', '?')}: {turn.get('value', '')}")
    return lines
