"""Display helpers for notebooks/inspect_dataset.ipynb, kept here (tested, importable) so the
notebook stays a thin sequence of calls. Needs IPython (present wherever a kernel runs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import matplotlib.pyplot as plt

from mmdata.inspect.dataset import QuarantineRecord, ShardSample
from mmdata.inspect.render import chat_html, draw_anyres_grid, loss_spans, sample_caption, table_html
from mmdata.inspect.stats import SampleStats, load_chat_tokenizer, measure_sample


def resolve_dataset(default: str) -> Path:
    """`$MMDATA_DATASET` when set, else `default` (relative paths from the repo root too)."""
    path = Path(os.environ.get("MMDATA_DATASET") or default)
    if not path.exists() and not path.is_absolute():
        for up in (Path.cwd().parent, Path(__file__).resolve().parents[2]):
            if (up / path).exists():
                return up / path
    return path


def show_sample(sample: ShardSample, chat: Any, *, max_side: int = 384) -> SampleStats:
    """A sample as the model sees it: counts, images with the anyres grid (or one tile each in
    multi-image samples), the chat with the loss spans highlighted."""
    from IPython.display import HTML, display  # lazy: IPython is there in a notebook only

    stats = measure_sample(sample, chat)
    display(HTML(f"<div style='font-family:monospace'>{sample_caption(stats)}</div>"))
    if stats.images and stats.error != "image_decode":
        n = len(stats.images)
        fig, axes = plt.subplots(1, n, figsize=(4 * n, 4), squeeze=False)
        for i, (ax, im) in enumerate(zip(axes[0], stats.images)):
            img = sample.open_image(i)
            shown = draw_anyres_grid(img, max_side=max_side) if n == 1 else img.convert("RGB")
            ax.imshow(shown)
            grid = f"grid {im.grid[0]}x{im.grid[1]}, " if im.grid != (0, 0) else "base tile only, "
            ax.set_title(
                f"{im.width}x{im.height} {im.format} — {grid}{im.tiles} tile{'s' if im.tiles > 1 else ''}, "
                f"{im.tokens} tokens",
                fontsize=9,
            )
            ax.axis("off")
        fig.tight_layout()
        plt.show()
    if stats.error:
        display(HTML(f"<b>the loader would skip this sample: {stats.error}</b>"))
    else:
        spans = loss_spans(
            sample.conversations,
            chat,
            [i.tokens for i in stats.images],
            [stats.video_tokens] if stats.video_tokens else [],
        )
        display(HTML(chat_html(spans)))
    return stats


def quarantine_html(records: Sequence[QuarantineRecord], limit: int = 200) -> str:
    """The quarantined records with their reasons (first `limit`)."""
    shown = records[:limit]
    headers = ["id", "reason", "location", "detail"]
    rows = [[q.id, q.reason, q.location, q.detail[:160]] for q in shown]
    title = f"Quarantined records ({len(records)}{'' if len(records) <= limit else f', first {limit}'})"
    return table_html(title, headers, rows or [["(none)"] + [""] * (len(headers) - 1)])


__all__ = ["resolve_dataset", "show_sample", "quarantine_html", "load_chat_tokenizer"]
