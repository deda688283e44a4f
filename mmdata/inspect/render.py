"""Turn a summary and samples into things people read: tables (rich for the terminal, HTML
for the notebook), the anyres tiling drawn over an image, and a conversation rendered as the
model sees it with the loss-bearing spans highlighted. All numbers come from the loader's
own code (anyres arithmetic, ChatTokenizer labels), so the picture cannot drift from training.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image, ImageDraw
from rich.table import Table as RichTable

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.inspect.stats import DatasetSummary, SampleStats
from mmdata.packing.geometry import DEFAULT_GEOMETRY
from mmdata.units import format_bytes

Table = tuple[str, list[str], list[list[str]]]  # (title, headers, rows)


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:,.1f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _share_rows(d: dict[str, dict[str, Any]]) -> list[list[str]]:
    return [[k, _fmt(v["count"]), f"{100 * v['share']:.1f}%"] for k, v in d.items()]


#: the geometry the length index (and inspect's own estimates) count image tokens with
INDEX_GEOMETRY_LABEL = f"{DEFAULT_GEOMETRY.image_size}-px tiles"


def geometry_label(geometry: dict[str, Any]) -> str:
    """A plan's geometry in a few words: the index's, or how it differs from it."""
    base = DEFAULT_GEOMETRY.as_dict()
    if geometry == base:
        return f"the index's ({INDEX_GEOMETRY_LABEL})"
    if set(geometry) <= set(base):  # LLaVA-OV geometry: name what differs
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in geometry.items() if base.get(k) != v)
    return ", ".join(f"{k} {str(v)[:12]}" for k, v in geometry.items())


def _plan_file_row(f: dict[str, Any]) -> list[str]:
    if "error" in f:
        return [f["file"], f["error"], "—", "—", "—", "—"]
    return [
        _fmt(f["seq_length"]),
        geometry_label(f["geometry"]),
        "estimated" if f["lengths_estimated"] else "exact",
        _fmt(f["samples"]),
        _fmt(f["sequences"]),
        _fill_exec(f["bin_fill"], f["executed_token_efficiency"]),
    ]


def summary_table_data(summary: DatasetSummary) -> list[Table]:
    """The summary as plain (title, headers, rows) tables, shared by the rich and HTML views."""
    d = summary.to_dict()
    sampled = d["sampled"]
    tables: list[Table] = [
        (
            "Dataset",
            ["field", "value"],
            [
                ["directory", d["dataset"]],
                ["samples", _fmt(d["samples"])],
                ["shards", _fmt(d["shards"])],
                ["bytes", format_bytes(d["bytes"])],
                ["quarantined", _fmt(d["quarantine"]["total"])],
                ["manifest", "yes" if d["manifest"] else "no"],
                [
                    "inspected",
                    "all samples"
                    if sampled["all"]
                    else f"{sampled['count']:,} random samples (seed {sampled['seed']})",
                ],
                ["tokenizer", d["tokenizer"] or "— (pass --tokenizer for text tokens and packing)"],
            ],
        ),
        (f"Sources (from {d['sources_from']})", ["source", "samples", "share"], _share_rows(d["sources"])),
        (
            "Quarantine",
            ["reason", "records"],
            [[k, _fmt(v)] for k, v in d["quarantine"]["reasons"].items()] or [["(none)", "0"]],
        ),
        *_preprocess_tables(d["preprocess"]),
        ("Modality (sampled)", ["modality", "samples", "share"], _share_rows(d["modality"])),
        ("Languages (sampled)", ["language", "samples", "share"], _share_rows(d["languages"])),
    ]
    dist_rows = []
    named = [
        ("turns / sample", d["turns_per_sample"]),
        ("image width", d["images"]["width"]),
        ("image height", d["images"]["height"]),
        ("aspect ratio (w/h)", d["images"]["aspect_ratio"]),
        ("tiles / image", d["images"]["tiles_per_image"]),
        ("image tokens / sample", d["image_tokens_per_sample"]),
        ("text tokens / sample", d["text_tokens_per_sample"]),
        ("loss tokens / sample", d["loss_tokens_per_sample"]),
        ("total tokens / sample", d["total_tokens_per_sample"]),
    ]
    for name, dist in named:
        if dist is None:
            dist_rows.append([name, *(["—"] * 7)])
        else:
            dist_rows.append([name, *(_fmt(dist[k]) for k in ("count", "mean", "min", "p50", "p90", "p99", "max"))])
    tables.append(("Distributions (sampled)", ["measure", "n", "mean", "min", "p50", "p90", "p99", "max"], dist_rows))
    grids = d["images"]["anyres_grids"]
    if grids:
        tables.append(
            (
                "Anyres grids (single-image samples)",
                ["grid (rows x cols)", "images"],
                [[k, _fmt(v)] for k, v in sorted(grids.items(), key=lambda kv: -kv[1])],
            )
        )
    li = d["length_index"]
    if li is not None:
        sides = ("online", "plan", "plan_file")
        tables.append(
            (
                f"Packing from the length index ({li['compared']:,} of {li['samples']:,} samples; text tokens: "
                f"{li['text_tokens']}); bin fill / executed-token efficiency at CP{li['cp']} TP{li['tp']}; "
                f"image tokens at the index's geometry ({INDEX_GEOMETRY_LABEL})",
                ["context", "online packer", "offline plan", "pack-plan file"],
                [
                    [_fmt(int(k)), *(_fill_exec(v["bin_fill"][x], v["executed_token_efficiency"][x]) for x in sides)]
                    for k, v in li["packing"].items()
                ],
            )
        )
    if d.get("plan_files"):
        tables.append(
            (
                f"Pack-plan files (pack-plan-<context>.parquet, each over the whole dataset, image tokens "
                f"at its own geometry); bin fill / executed-token efficiency at CP{summary.cp} TP{summary.tp}",
                ["context", "geometry", "text lengths", "samples", "sequences", "bin fill / executed"],
                [_plan_file_row(f) for f in d["plan_files"]],
            )
        )
    vb = d.get("vision_balance")
    if vb is not None and "packing" in vb:
        tables.append(
            (
                f"Vision balance: max/mean vision work per rank per step, mean (worst) over steps; "
                f"DP{vb['dp']}, micro-batch {vb['micro_batch_size']}, global batch {vb['global_batch_size']} "
                f"({vb['compared']:,} samples of the length index)",
                [
                    "context",
                    "online today",
                    "online balanced",
                    f"online, window of {vb['window']} steps",
                    "plan today",
                    "plan balanced",
                ],
                [
                    [
                        _fmt(int(k)),
                        _balance(v["online"]["today"]),
                        _balance(v["online"]["balanced"]),
                        _balance(v["online"].get("windowed", v["online"]["balanced"])),
                        _balance(v["plan"]["today"]),
                        _balance(v["plan"]["balanced"]),
                    ]
                    for k, v in vb["packing"].items()
                ],
            )
        )
    if (gr := d.get("global_reads")) is not None:
        tables.append(global_reads_table(gr))
    if d["packing"] is not None:
        tables.append(
            (
                "Packing (the loader's packer on the sampled lengths)",
                ["context", "bin fill / executed", "sequences", "over length"],
                [
                    [
                        _fmt(int(k)),
                        _fill_exec(v["bin_fill"], v["executed_token_efficiency"]),
                        _fmt(v["sequences"]),
                        _fmt(v["over_length"]),
                    ]
                    for k, v in d["packing"].items()
                ],
            )
        )
    return tables


def _preprocess_tables(pre: dict[str, Any] | None) -> list[Table]:
    """What `mmdata preprocess` counted beyond sources and quarantine (from the manifest)."""
    if not pre:
        return []
    tables: list[Table] = []
    if "media_resolution" in pre:
        tables.append(
            (
                "Media resolution (valid records; manifest)",
                ["how the media were found", "records"],
                [[k.replace("_", " "), _fmt(v)] for k, v in pre["media_resolution"].items()],
            )
        )
    rows = [[f"filtered: {rule}", _fmt(n)] for rule, n in pre.get("by_filter", {}).items()]
    dedup = (pre.get("curation") or {}).get("dedup")
    if dedup:
        rows.append([f"duplicates (phash:{dedup['distance']}, scope {dedup['scope']})", _fmt(pre.get("duplicates", 0))])
    mix = (pre.get("curation") or {}).get("mix")
    if mix:
        rows.append([f"mixed out (mix by {mix['by']})", _fmt(pre.get("mixed_out", 0))])
        rows.append(["repeated (mix)", _fmt(pre.get("repeated", 0))])
        rows += [
            [f"mix {g or '(none)'}: target → realised", f"{_fmt(mix['target'][g])} → {_fmt(mix['realised'][g])}"]
            for g in mix.get("target", {})
        ]
    if rows:
        tables.append(("Curation (manifest)", ["what", "records"], rows))
    return tables


def global_reads_table(gr: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """The bytes each DP rank reads per step with `data.sharding: global`, beside `replicated`."""
    first = next(iter(gr["packing"].values()), {"steps": 0})
    title = (
        f"Reads per step with data.sharding: global (each rank reads its placed rows; replicated: every rank "
        f"the whole step), mean over the first {first['steps']} steps; DP{gr['dp']}, micro-batch "
        f"{gr['micro_batch_size']}, global batch {gr['global_batch_size']}"
    )
    headers = ["context", "replicated, per rank", "global, per rank (mean)", "global, busiest rank", "share"]
    rows = [
        [
            _fmt(int(k)),
            format_bytes(v["step_bytes"]),
            format_bytes(v["rank_mean"]),
            format_bytes(v["rank_max"]),
            _fmt(v["rank_share"]),
        ]
        for k, v in gr["packing"].items()
    ]
    return title, headers, rows


def _balance(report: dict[str, Any]) -> str:
    """`1.047 (1.162)`: mean and worst step, `—` without vision work."""
    return "—" if report["mean"] is None else f"{report['mean']:.3f} ({report['worst']:.3f})"


def _fill_exec(fill: float | None, executed: float | None) -> str:
    """`99.6% / 99.2%`: bin fill and executed-token efficiency, `—` when unknown."""
    return "—" if fill is None else f"{100 * fill:.1f}% / {100 * executed:.1f}%"


def summary_tables(summary: DatasetSummary) -> list[Any]:
    """rich Tables for the terminal."""
    out = []
    for title, headers, rows in summary_table_data(summary):
        t = RichTable(title=title, title_justify="left")
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            t.add_row(*row)
        out.append(t)
    return out


def table_html(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f'<table class="mmdata-inspect"><caption style="text-align:left;font-weight:bold">'
        f"{html.escape(title)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def summary_html(summary: DatasetSummary) -> str:
    """All summary tables as one HTML fragment (the notebook displays it)."""
    return "\n".join(table_html(*t) for t in summary_table_data(summary))


# ----------------------------------------------------------------------------- anyres picture


@dataclass
class AnyresLayout:
    """How one image is tiled: the chosen canvas, the resized image on it, the grid, tokens."""

    orig_hw: tuple[int, int]
    canvas_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    grid: tuple[int, int]
    tiles: int
    tokens: int


def anyres_layout(height: int, width: int, max_tiles: int = anyres.DEFAULT_MAX_TILES) -> AnyresLayout:
    best_h, best_w = anyres.select_best_resolution(height, width, anyres.grid_pinpoints())
    new_h, new_w = anyres.resize_for_patching(height, width, best_h, best_w)
    rows, cols = best_h // anyres.DEFAULT_IMAGE_SIZE, best_w // anyres.DEFAULT_IMAGE_SIZE
    return AnyresLayout(
        (height, width),
        (best_h, best_w),
        (new_h, new_w),
        (rows, cols),
        1 + rows * cols,
        anyres.num_image_tokens(height, width, max_tiles=max_tiles),
    )


def draw_anyres_grid(image: Image.Image, max_side: int = 512, max_tiles: int = anyres.DEFAULT_MAX_TILES) -> Image.Image:
    """The padded anyres canvas (image resized as the loader does, black padding) scaled to fit
    `max_side`, with the 384-px tile boundaries drawn in red."""
    img = anyres.to_rgb(image)
    lay = anyres_layout(img.height, img.width, max_tiles)
    (ch, cw), (nh, nw) = lay.canvas_hw, lay.resized_hw
    s = min(1.0, max_side / max(ch, cw))
    canvas = Image.new("RGB", (max(1, round(cw * s)), max(1, round(ch * s))), (0, 0, 0))
    small = img.resize((max(1, round(nw * s)), max(1, round(nh * s))), Image.Resampling.BILINEAR)
    canvas.paste(small, (round((cw - nw) // 2 * s), round((ch - nh) // 2 * s)))
    draw = ImageDraw.Draw(canvas)
    tile = anyres.DEFAULT_IMAGE_SIZE * s
    width = max(1, round(3 * s)) + 1
    for r in range(lay.grid[0] + 1):
        y = min(round(r * tile), canvas.height - 1)
        draw.line([(0, y), (canvas.width, y)], fill=(255, 40, 40), width=width)
    for c in range(lay.grid[1] + 1):
        x = min(round(c * tile), canvas.width - 1)
        draw.line([(x, 0), (x, canvas.height)], fill=(255, 40, 40), width=width)
    return canvas


# ----------------------------------------------------------------------------- chat with loss


@dataclass
class Span:
    text: str
    loss: bool  # the loss applies to every token of this span
    media: str | None = None  # "image"/"video" for an expanded media run
    tokens: int = 0


def loss_spans(
    conversations: Sequence[dict], chat: Any, image_tokens: Sequence[int] = (), video_tokens: Sequence[int] = ()
) -> list[Span]:
    """The tokenized conversation cut into runs of loss / no-loss / media tokens, decoded back
    to text with the loader's `ChatTokenizer` (labels != -100 is where the loss applies)."""
    toks = chat.tokenize(conversations, list(image_tokens), list(video_tokens))
    ids, labels = toks.input_ids.tolist(), toks.labels.tolist()
    media_at = {start: (kind, n) for kind, start, n in toks.media_spans}
    spans: list[Span] = []
    run: list[int] = []
    run_loss = False

    def flush() -> None:
        if run:
            text = chat.tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            spans.append(Span(text, run_loss, None, len(run)))
            run.clear()

    i = 0
    while i < len(ids):
        if i in media_at:
            flush()
            kind, n = media_at[i]
            spans.append(Span(f"<{kind}>", False, kind, n))
            i += n
            continue
        is_loss = labels[i] != -100
        if run and is_loss != run_loss:
            flush()
        run_loss = is_loss
        run.append(ids[i])
        i += 1
    flush()
    return spans


def chat_html(spans: Sequence[Span], title: str = "") -> str:
    """Spans as a monospace chat transcript; loss spans highlighted green, media as badges."""
    parts = []
    for sp in spans:
        if sp.media:
            parts.append(
                f'<span style="background:#cfe0ff;border-radius:3px;padding:0 3px">'
                f"[{sp.media}: {sp.tokens:,} tokens]</span>"
            )
        else:
            text = html.escape(sp.text)
            parts.append(
                f'<span style="background:#b8f0b8" title="loss: {sp.tokens} tokens">{text}</span>'
                if sp.loss
                else f'<span style="color:#444">{text}</span>'
            )
    head = f"<div style='font-weight:bold'>{html.escape(title)}</div>" if title else ""
    legend = (
        "<div style='font-size:85%;color:#666'>green = loss applies (labels != -100); "
        "blue = media tokens (no loss)</div>"
    )
    return (
        f"<div style='margin:6px 0'>{head}{legend}<pre style='white-space:pre-wrap;font-size:90%'>"
        f"{''.join(parts)}</pre></div>"
    )


def sample_caption(stats: SampleStats) -> str:
    """One line of counts for a sample (text/image/loss tokens, turns, language)."""
    tt = "?" if stats.text_tokens is None else f"{stats.text_tokens:,}"
    lt = "?" if stats.loss_tokens is None else f"{stats.loss_tokens:,}"
    total = "?" if stats.total_tokens is None else f"{stats.total_tokens:,}"
    return (
        f"key {stats.key} · id {stats.id} · source {stats.source or '—'} · {stats.modality} · "
        f"{stats.turns} turns · {stats.language} · tokens: text {tt} + image {stats.image_tokens:,} "
        f"= {total} (loss on {lt})"
    )
