"""matplotlib figures of a DatasetSummary, one function per question a reviewer asks
(how big are the images, how many tiles, where do the tokens go, how well does it pack, what
is the mix). Each returns the Figure; in a notebook the inline backend shows it."""

from __future__ import annotations

import numpy as np
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from mmdata.inspect.stats import DatasetSummary


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the sample", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_image_sizes(summary: DatasetSummary) -> Figure:
    """Width x height scatter (log-log) and the aspect-ratio histogram (log x)."""
    imgs = summary.images
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if not imgs:
        _empty(a, "images")
        _empty(b, "images")
        return fig
    w = np.array([i.width for i in imgs])
    h = np.array([i.height for i in imgs])
    a.scatter(w, h, s=10, alpha=0.5)
    a.set(xscale="log", yscale="log", xlabel="width (px)", ylabel="height (px)", title=f"image sizes (n={len(imgs)})")
    ar = w / h
    bins = np.logspace(np.log10(ar.min()) - 0.05, np.log10(ar.max()) + 0.05, 30)
    b.hist(ar, bins=bins)
    b.set(xscale="log", xlabel="aspect ratio w/h", ylabel="images", title="aspect ratios")
    fig.tight_layout()
    return fig


def plot_tiles(summary: DatasetSummary) -> Figure:
    """Tiles per image (base + anyres grid; 1 for images of multi-image samples)."""
    tiles = [i.tiles for i in summary.images]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if not tiles:
        _empty(ax, "images")
        return fig
    ax.hist(tiles, bins=np.arange(0.5, max(tiles) + 1.5, 1))
    ax.set(xlabel="tiles per image", ylabel="images", title="anyres tiles per image")
    return fig


def plot_tokens(summary: DatasetSummary) -> Figure:
    """Tokens per sample: text vs image, and the total (text needs a tokenizer)."""
    s = summary.samples
    img = np.array([x.image_tokens for x in s])
    txt = np.array([x.text_tokens for x in s if x.text_tokens is not None])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    pos = np.concatenate([img[img > 0], txt[txt > 0]])
    if pos.size:
        # log bins: text is tens to hundreds of tokens, images hundreds to thousands
        bins = np.logspace(np.log10(pos.min()) - 0.05, np.log10(pos.max()) + 0.05, 40)
        a.hist(img[img > 0], bins=bins, alpha=0.6, label=f"image tokens ({int((img == 0).sum())} samples with none)")
        if txt.size:
            a.hist(txt[txt > 0], bins=bins, alpha=0.6, label="text tokens")
        a.set_xscale("log")
        a.legend(fontsize=8)
    else:
        _empty(a, "tokens")
    a.set(xlabel="tokens per sample", ylabel="samples", title="text vs image tokens")
    tot = [x.total_tokens for x in s if x.total_tokens is not None]
    if tot:
        b.hist(tot, bins=40)
        b.set(xlabel="total tokens per sample", ylabel="samples", title="total tokens per sample")
    else:
        _empty(b, "tokenizer")
    fig.tight_layout()
    return fig


def plot_packing(summary: DatasetSummary) -> Figure:
    """Packing efficiency (real tokens / slots) per context length."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    eff = summary.packing()
    if not eff:
        _empty(ax, "token lengths")
        return fig
    labels = [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in eff]
    bars = ax.bar(labels, [100 * v.efficiency for v in eff.values()])
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set(ylim=(0, 105), xlabel="context length", ylabel="efficiency (%)", title="packing efficiency")
    return fig


def plot_mix(summary: DatasetSummary) -> Figure:
    """Source mix, modality mix and languages side by side."""
    d = summary.to_dict()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title in zip(
        axes,
        ("sources", "modality", "languages"),
        (f"sources ({d['sources_from']})", "modality (sampled)", "languages (sampled)"),
    ):
        items = d[key]
        if not items:
            _empty(ax, key)
            continue
        ax.barh(list(items), [v["share"] * 100 for v in items.values()])
        ax.invert_yaxis()
        ax.set(xlabel="share (%)", title=title)
    fig.tight_layout()
    return fig
