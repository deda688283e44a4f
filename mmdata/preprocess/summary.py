"""The summary table `mmdata preprocess` prints at the end (its counts per source, reason and
filter; shards, bytes and throughput)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from mmdata.units import format_bytes, plural


def summary_table(manifest: dict, out: Path | None = None) -> Table:
    """The run's counts; `out` is where the shards are now (the manifest's `run.output` is where
    they were written, which differs for a copied folder)."""
    c = manifest["counts"]
    cols = ["read", "written", "quarantined"] + [
        k for k in ("filtered", "duplicates", "mixed_out", "repeated") if c.get(k)
    ]
    t = Table(title=f"mmdata preprocess: {out or manifest['run']['output']}")
    t.add_column("what")
    for col in cols:
        t.add_column(col.replace("_", " "), justify="right")
    t.add_row("[bold]all", *(f"{c[k]:,}" for k in cols))
    for src, sc in c["by_source"].items():
        t.add_row(f"source {src or '(none)'}", *(f"{sc.get(k, 0):,}" for k in cols))
    for reason, n in c["by_reason"].items():
        t.add_row(f"reason {reason}", "", "", f"{n:,}", *("" for _ in cols[3:]))
    for rule, n in c.get("by_filter", {}).items():  # (the filtered column comes right after quarantined)
        t.add_row(f"filter {rule}", "", "", "", f"{n:,}", *("" for _ in cols[4:]))
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    wall = manifest.get("wall_time_s") or 0.0
    resumed = any((manifest.get("run") or {}).get("resumed", {}).values())
    rate = "resumed run" if resumed else f"{c['read'] / max(wall, 1e-9):,.0f} records/s"
    t.caption = (
        f"{shards_line(manifest['shards'])}, {format_bytes(total_bytes)}, {wall:.1f} s ({rate})\n"
        f"{media_resolution_line(c['media_resolution'])}"
    )
    mix = (manifest.get("curation") or {}).get("mix")
    if mix and "realised" in mix:
        t.caption += "\nmix (target → realised): " + " · ".join(
            f"{g or '(none)'} {mix['target'][g]:,} → {mix['realised'][g]:,}" for g in mix["target"]
        )
    return t


def media_resolution_line(mr: dict[str, int]) -> str:
    """e.g. "media found by stem 9,998,812 · by name 12 · by basename 0; unreferenced members 3"."""
    found = " · ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in mr.items() if k.startswith("by_"))
    return f"media found {found}; unreferenced members {mr.get('unreferenced_members', 0):,}"


def shards_line(shards: list[dict]) -> str:
    """ "4 shards of 50 samples (the last 44)" from the shards' own sample counts."""
    counts = [int(s["samples"]) for s in shards]
    if not counts:
        return "0 shards"
    head = f"{plural(len(counts), 'shard')} of {plural(max(counts), 'sample')}"
    if len(set(counts[:-1])) <= 1 and counts[-1] <= counts[0]:
        return head + (f" (the last {counts[-1]:,})" if counts[-1] != counts[0] else "")
    return f"{plural(len(counts), 'shard')} of {min(counts):,}-{max(counts):,} samples"
