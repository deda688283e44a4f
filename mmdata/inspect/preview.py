"""One sample of a shard folder as the model will see it (`mmdata preview`; the command line:
mmdata/commands/preview.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image
from rich.console import Console
from rich.text import Text

from mmdata.errors import UserError
from mmdata.inspect.dataset import find_sample, open_dataset, read_shard
from mmdata.inspect.render import draw_anyres_grid, loss_spans
from mmdata.inspect.stats import load_chat_tokenizer, measure_sample
from mmdata.inspect.tokens import is_token_dataset, preview_lines

LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"


def run(args: argparse.Namespace) -> int:
    ds = open_dataset(args.dir)
    if args.key is not None:
        try:
            sample = find_sample(ds, args.key)
        except ValueError as err:  # a sample key of another dataset
            raise UserError(f"--key {err}") from None
        if sample is None:
            raise UserError(f"{args.dir}: no sample with key or id {args.key!r}")
        position = None
    else:
        position = 0 if args.index is None else args.index
        total = ds.total_samples
        if not 0 <= position < total:
            raise UserError(
                f"--index {position} is out of range: {args.dir} holds {total:,} samples (0..{total - 1:,})"
            )
        shard, pos = ds.locate(position)
        sample = next(read_shard(shard, [pos]))
    if is_token_dataset(args.dir):  # Emu3 VQ token shards: code grids, no pictures to tile
        if args.tiles_png is not None:
            raise UserError(
                f"{args.dir} holds Emu3 VQ token shards (code grids, no images): --tiles-png needs the "
                "image shards they were made from (their manifest's input path)"
            )
        console = Console(highlight=False, soft_wrap=True)
        for i, line in enumerate(preview_lines(sample, position)):
            console.print(Text(line, style="bold" if i == 0 else ""))
        return 0
    chat = load_chat_tokenizer(args.tokenizer, what="--tokenizer") if args.tokenizer else None
    stats = measure_sample(sample, chat)
    console = Console(highlight=False, soft_wrap=True)  # long lines stay whole in pipes and logs
    console.print(Text(_header(sample, stats, position), style="bold"))
    for line in _media_lines(stats):
        console.print(line)
    console.print(_token_line(stats))
    if stats.error:
        console.print(Text(f"the loader would skip this sample: {stats.error}", style="bold red"))
    console.print(_conversation(sample, stats, chat))
    if args.tiles_png is not None:
        _write_tiles_png(sample, stats, args.tiles_png)
        console.print(f"tiles: {args.tiles_png}")
    return 0


def _header(sample, stats, position: int | None) -> str:
    where = f"{stats.shard} #{sample.index}" + (f", global index {position:,}" if position is not None else "")
    return (
        f"sample {stats.key} · id {stats.id} · source {stats.source or '—'} · {where} · {stats.modality} · "
        f"{stats.turns} turn{'s' if stats.turns != 1 else ''} · {stats.language}"
    )


def _media_lines(stats) -> list[str]:
    lines = []
    for im in stats.images:
        tiling = f"anyres grid {im.grid[0]}x{im.grid[1]} + base tile" if im.grid != (0, 0) else "base tile only"
        lines.append(
            f"  image {im.name}: {im.format or '?'} {im.width}x{im.height} → {tiling} = "
            f"{im.tiles} tile{'s' if im.tiles != 1 else ''}, {im.tokens:,} tokens"
        )
    if stats.video_tokens:
        lines.append(f"  video: {stats.video_tokens:,} tokens")
    return lines


def _token_line(stats) -> str:
    if stats.text_tokens is None:
        return f"tokens: image {stats.image_tokens:,} (text and loss tokens: pass --tokenizer)"
    return (
        f"tokens: text {stats.text_tokens:,} + image {stats.image_tokens:,} = {stats.total_tokens:,} "
        f"(loss on {stats.loss_tokens:,})"
    )


def _conversation(sample, stats, chat):
    """The turns as written (no tokenizer), or as the model sees them: chat template applied,
    media expanded to their token counts, loss spans in green between ⟦ ⟧."""
    text = Text()
    if chat is None or stats.error:
        for turn in sample.conversations:
            text.append(f"{turn.get('from', '?')}: ", style="bold")
            text.append(f"{turn.get('value', '')}\n")
        return text
    text.append(f"conversation as the model sees it (loss on {LOSS_OPEN}...{LOSS_CLOSE}):\n", style="dim")
    spans = loss_spans(
        sample.conversations, chat, [i.tokens for i in stats.images], [stats.video_tokens] if stats.video_tokens else []
    )
    for sp in spans:
        if sp.media:
            text.append(f"[{sp.media}: {sp.tokens:,} tokens]", style="bold blue")
        elif sp.loss:
            text.append(f"{LOSS_OPEN}{sp.text}{LOSS_CLOSE}", style="bold green")
        else:
            text.append(sp.text)
    return text


def _write_tiles_png(sample, stats, out: Path) -> None:
    """One image: the anyres canvas with its tile grid; several: each image as its one base tile."""
    if not stats.images or stats.error == "image_decode":
        raise UserError(f"sample {stats.key} has no decodable image to draw (--tiles-png)")
    single = len(stats.images) == 1
    pictures = []
    for i in range(len(stats.images)):
        img = sample.open_image(i)
        if single:
            img = draw_anyres_grid(img)
        else:
            img = img.convert("RGB")
            img.thumbnail((384, 384))
        pictures.append(img)
    height = max(p.height for p in pictures)
    sheet = Image.new("RGB", (sum(p.width for p in pictures) + 8 * (len(pictures) - 1), height), (255, 255, 255))
    x = 0
    for p in pictures:
        sheet.paste(p, (x, 0))
        x += p.width + 8
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out, format="PNG")
