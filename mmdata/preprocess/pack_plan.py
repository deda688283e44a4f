"""`mmdata pack-plan DIR --seq-length N`: a deterministic global packing plan from the length
index, so a loader can pack exactly and reproducibly, independent of any buffer size.

The plan walks the samples in a seeded random order, a window of 256 (the loader's packing
buffer) at a time, and packs each window with the loader's own `largest_first_knapsack` (open a
sequence with the largest sample, fill the rest as full as possible by subset-sum). Unlike the
online packer, which must emit every sequence of its buffer, the plan carries the samples of
sequences filled below 99.5 % into the next window (at most half a window of them), where they
meet new partners; only the very end of the data is emitted as it is. On the synthetic mix that
lifts the efficiency from about 98.6 % (online) to over 99.5 % at 8K (tests/test_pack_plan.py).
Samples longer than N go alone into a sequence (`over_length`; the loader truncates their text
or drops them). The result is a pure function of (lengths, N, seed).

The plan file (`DIR/pack-plan-<N>.parquet`, see docs/preprocess.md "Packing plan"), one row per
sample in plan order: `bin` (the sequence's number, 0..bins-1 in plan order), `index` (the
sample's global index; its shard key is `f"{index:010d}"`), `tokens` (its length). The schema
metadata `mmdata.pack_plan` holds the settings and the checks a loader needs, among them the
image token geometry it counted with (`geometry`: image_size, patch_size, max_tiles, grid_max,
video_frames). The length index counts with LLaVA-OV's own geometry (729 tokens per 384-px tile);
`--recipe RECIPE.yaml` (or the geometry flags) plans for the recipe's vision tower instead: the
image tokens are then recounted from the records' image header sizes, the text tokens kept.
Training refuses a plan whose geometry differs from the recipe's (`plan_packing.plan_for_data`).

Emu3 token shards (`mmdata tokenize-images --tokenizer`, whose length index holds each sample's
length per Emu3 task) are planned with Emu3's settings instead (the recipe's with `--recipe`,
else the defaults): each sample's task and caption drop are drawn here and written to the plan
(`variant`, with the samples' `key`s), the loader encodes each sample as its variant says, and
the geometry records the tokenizer, prompts, task weights and CFG rate
(energon_loaders/emu3/plan_lengths.py).
The metadata's `packing_report` (also printed) holds the plan's bin fill and executed-token
efficiency at `--cp`/`--tp` (default: the recipe's parallel sizes), CP padding counted as the
runtime pads (energon_loaders/packing_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from mmdata.energon_loaders.balance import DEFAULT_TILE_TOKENS
from mmdata.energon_loaders.llava_ov import anyres_math as anyres
from mmdata.energon_loaders.video import DEFAULT_MAX_FRAMES
from mmdata.preprocess.lengths import LENGTHS_NAME, VISION_TILES, media_tiles
from mmdata.vision_tokens.lengths import index_meta

if TYPE_CHECKING:
    from mmdata.energon_loaders.balance import StepShape
    from mmdata.energon_loaders.emu3.plan_lengths import Emu3PlanGeometry
    from mmdata.energon_loaders.packing_report import PackingReport

PLAN_FORMAT = 1
WINDOW = 256  # the loader's packing buffer (energon_loaders.packing.DEFAULT_PACKING_BUFFER)
CARRY_BELOW = 0.995  # sequences filled less than this go back into the next window ...
MAX_CARRY = WINDOW // 2  # ... up to this many samples
CHUNK = 1 << 20  # samples planned independently (in parallel); about a minute of CPU each
BALANCE_STREAM = 1  # the balanced order's random stream: default_rng([seed, BALANCE_STREAM])


@dataclass(frozen=True)
class PlanGeometry:
    """What a sample's image tokens depend on besides its image sizes: the vision tower's tile
    and patch, the anyres tile budget and grid, the video frame limit (the loader's settings)."""

    image_size: int = anyres.DEFAULT_IMAGE_SIZE
    patch_size: int = anyres.DEFAULT_PATCH_SIZE
    max_tiles: int = anyres.DEFAULT_MAX_TILES
    grid_max: int = anyres.DEFAULT_GRID_MAX
    video_frames: int = DEFAULT_MAX_FRAMES

    counts: ClassVar[str] = "image tokens (LLaVA-OV image geometry)"  # what a plan made with it counted

    def as_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in GEOMETRY_FIELDS}

    def flags(self) -> str:
        """The pack-plan options that make a plan with this geometry."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.as_dict().items())

    def differences(self, want: "PlanGeometry") -> list[str]:
        return geometry_differences(self, want)

    def remedy(self, shards: Path, seq_length: int) -> str:
        """The command that makes the plan a recipe with this geometry needs."""
        return (f"run `mmdata pack-plan {shards} --seq-length {seq_length} {self.flags()}` "
                "(or `mmdata pack-plan --recipe RECIPE.yaml`)")

    def media_tokens(self, record: dict) -> int:
        """LLM positions of a record's media, as the LLaVA-OV loader lays them out with this
        geometry (lengths.media_tokens at the default one), from the validator's header sizes."""
        meta = record.get("meta") or {}
        sizes = meta.get("image_sizes") or []
        total = sum(anyres.image_layout(h, w, len(sizes) == 1, image_size=self.image_size, patch_size=self.patch_size,
                                        max_tiles=self.max_tiles, grid_max=self.grid_max)[1] for w, h, _ in sizes)
        video = meta.get("video_size_frames")
        if video:
            total += anyres.num_video_tokens(min(int(video[2]), self.video_frames), self.image_size, self.patch_size)
        return total

    def media_tiles(self, record: dict) -> int:
        """Tiles and frames the vision tower encodes for a record with this geometry (lengths.media_tiles)."""
        return media_tiles(record, image_size=self.image_size, grid_max=self.grid_max, video_frames=self.video_frames)


GEOMETRY_FIELDS = ("image_size", "patch_size", "max_tiles", "grid_max", "video_frames")
DEFAULT_GEOMETRY = PlanGeometry()


def recipe_geometry(recipe) -> "PlanGeometry | Emu3PlanGeometry | None":
    """What an mmtrain recipe's plans must have counted with: the image token geometry of a
    LLaVA-OV recipe (its `model.vision`, `model.max_tiles`, `model.grid_max`,
    `data.video_frames`, what the loader is built with), the task settings and tokenizer of an
    Emu3 recipe (`data.tasks`, `p_uncond`, `uncond_prompt`, `system_prompt`, `tokenizer.path`);
    None for a recipe with neither."""
    m, d = recipe.model, recipe.data
    if hasattr(d, "p_uncond"):  # Emu3's data section: its samples' lengths depend on the task settings
        from mmdata.energon_loaders.emu3.plan_lengths import Emu3PlanGeometry

        return Emu3PlanGeometry.from_recipe(recipe)
    vision = getattr(m, "vision", None)
    if vision is None or not hasattr(m, "max_tiles"):
        return None
    grid_max = getattr(m, "grid_max", anyres.DEFAULT_GRID_MAX)
    return PlanGeometry(vision.image_size, vision.patch_size, m.max_tiles, grid_max,
                        getattr(d, "video_frames", DEFAULT_MAX_FRAMES))


def plan_geometry(info: dict) -> "PlanGeometry | Emu3PlanGeometry | None":
    """The geometry a plan recorded; None for a plan made before plans recorded it (those
    counted with the default image geometry)."""
    g = info.get("geometry")
    if not isinstance(g, dict):
        return None
    from mmdata.energon_loaders.emu3.plan_lengths import KIND, Emu3PlanGeometry

    if g.get("kind") == KIND:
        return Emu3PlanGeometry.from_dict(g)
    return PlanGeometry(**{k: int(g[k]) for k in GEOMETRY_FIELDS if k in g})


def geometry_differences(have: PlanGeometry, want: PlanGeometry) -> list[str]:
    """`field plan X, recipe Y` for each field that differs."""
    return [f"{k} {getattr(have, k)} (recipe: {getattr(want, k)})" for k in GEOMETRY_FIELDS
            if getattr(have, k) != getattr(want, k)]


@dataclass
class PackPlan:
    seq_length: int
    bins: list[np.ndarray]  # per sequence (plan order): sample positions in the lengths array
    lengths: np.ndarray  # the lengths the plan was made from

    def sequence_sums(self, per_sample: np.ndarray, clip: bool = False) -> np.ndarray:
        """Per sequence (plan order), the sum of a per-sample array (`clip`: lengths as packed, at
        most seq_length)."""
        values = (np.minimum(per_sample, self.seq_length) if clip else np.asarray(per_sample)).astype(np.int64)
        if not self.bins:
            return np.zeros(0, dtype=np.int64)
        starts = np.cumsum([0] + [len(b) for b in self.bins[:-1]])
        return np.add.reduceat(values[np.concatenate(self.bins)], starts)  # (bins are never empty)

    def balanced(self, tiles: np.ndarray, shape: "StepShape", tile_tokens: float, seed: int) -> "PackPlan":
        """The same sequences in the order of vision-aware balancing for `shape` (balance.tiered_order:
        steps of whole tiers of equal-cost sequences), seeded apart from the samples' order."""
        from mmdata.energon_loaders.balance import row_costs, tiered_order

        costs = row_costs(self.sequence_sums(self.lengths, clip=True), self.sequence_sums(tiles), tile_tokens)
        order = tiered_order(costs, shape.dp, np.random.default_rng([seed, BALANCE_STREAM]))
        return PackPlan(self.seq_length, [self.bins[i] for i in order], self.lengths)

    def vision_balance(self, tiles: np.ndarray, shape: "StepShape", tile_tokens: float, balanced: bool):
        """`balance.plan_balance` of this plan's order: dealt as the plain contract deals it, or
        placed per step as a balanced plan's loader places it."""
        from mmdata.energon_loaders.balance import plan_balance

        return plan_balance(self.sequence_sums(self.lengths, clip=True), self.sequence_sums(tiles), shape, tile_tokens,
                            balanced)

    @property
    def over_length(self) -> int:
        return int((self.lengths > self.seq_length).sum())

    @property
    def efficiency(self) -> float:
        """Real tokens (an over-length sample counts as N) over the slots of all sequences."""
        if not self.bins:
            return 0.0
        return float(np.minimum(self.lengths, self.seq_length).sum()) / (len(self.bins) * self.seq_length)

    def report(self, cp: int = 1, tp: int = 1) -> "PackingReport":
        """Bin fill and executed-token efficiency of the plan's sequences as rows trained at
        context parallelism `cp` and tensor parallelism `tp` (energon_loaders/packing_report.py)."""
        from mmdata.energon_loaders.packing_report import report_from_bins

        if not self.bins:
            return report_from_bins(np.zeros(0, np.int64), np.zeros(0, np.int64), self.seq_length, cp=cp, tp=tp)
        pos = np.concatenate(self.bins)
        rows = np.repeat(np.arange(len(self.bins), dtype=np.int64), [len(b) for b in self.bins])
        return report_from_bins(rows, self.lengths[pos], self.seq_length, num_rows=len(self.bins), cp=cp, tp=tp)


def _pack_chunk(order: np.ndarray, clipped: np.ndarray, seq_length: int) -> list[np.ndarray]:
    """The sequences of one chunk of the seeded order (windows with carry-over)."""
    from mmdata.energon_loaders.packing import largest_first_knapsack

    bins: list[np.ndarray] = []
    pool = np.zeros(0, dtype=np.int64)
    for start in range(0, len(order), WINDOW):
        pool = np.concatenate([pool, order[start:start + WINDOW]])
        last = start + WINDOW >= len(order)
        packed = [pool[np.asarray(b)] for b in largest_first_knapsack(clipped[pool].tolist(), seq_length)]
        fill = [int(clipped[b].sum()) for b in packed]
        carry: list[np.ndarray] = []
        carried = 0
        # the least filled sequences are carried first, while they fit the carry budget
        for j in sorted(range(len(packed)), key=lambda j: (fill[j], j)):
            b = packed[j]
            if not last and fill[j] < CARRY_BELOW * seq_length and carried + len(b) <= MAX_CARRY:
                carry.append(b)
                carried += len(b)
        kept = {id(b) for b in carry}
        bins.extend(np.sort(b) for b in packed if id(b) not in kept)
        pool = np.concatenate(carry) if carry else np.zeros(0, dtype=np.int64)
    return bins


def plan_packing(lengths: np.ndarray, seq_length: int, seed: int = 0, jobs: int = 1,
                 on_chunk: Callable[[int], None] | None = None) -> PackPlan:
    """Windowed largest-first knapsack with carry-over (see the module docstring). The seeded
    order is cut into chunks of CHUNK samples packed independently (in `jobs` processes) and
    concatenated in order, so the plan does not depend on `jobs`. `on_chunk(total)` is called
    once per packed chunk (progress)."""
    if seq_length <= 0:
        raise ValueError("seq_length must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    clipped = np.minimum(lengths, seq_length)
    order = np.random.default_rng(seed).permutation(len(lengths))
    chunks = [order[i:i + CHUNK] for i in range(0, len(order), CHUNK)]
    if jobs > 1 and len(chunks) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(chunks))) as pool:
            parts = []
            for part in pool.map(_pack_chunk, chunks, [clipped] * len(chunks), [seq_length] * len(chunks)):
                parts.append(part)
                if on_chunk is not None:
                    on_chunk(len(chunks))
    else:
        parts = []
        for c in chunks:
            parts.append(_pack_chunk(c, clipped, seq_length))
            if on_chunk is not None:
                on_chunk(len(chunks))
    return PackPlan(seq_length, [b for part in parts for b in part], lengths)


def plan_path(root: Path, seq_length: int) -> Path:
    return root / f"pack-plan-{seq_length}.parquet"


def read_lengths(root: Path):
    """The length index of a shards folder as a pyarrow Table."""
    import pyarrow.parquet as pq

    path = root / LENGTHS_NAME
    if not path.is_file():
        manifest = root / "manifest.json"
        tool = json.loads(manifest.read_text()).get("tool") if manifest.is_file() else None
        how = "rerun `mmdata tokenize-images` with --tokenizer DIR (the Emu3 text tokenizer training uses)" \
            if tool == "mmdata tokenize-images" else "run `mmdata preprocess` (it writes the length index)"
        raise FileNotFoundError(f"{path} not found: {how}")
    return pq.read_table(path)


def recount_media(root: Path, table, geometry: PlanGeometry,
                  on_shard: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per length-index row: (its text tokens plus its media tokens, its vision tiles), the media
    recounted with `geometry` from the records in the shards (`{key}.json`, only those members are
    read). `on_shard(total)` is called once per shard read (progress)."""
    import tarfile

    from mmdata import shard_format as sf

    index = table.column("index").to_numpy()
    media = np.full((int(index.max()) + 1 if len(index) else 0, 2), -1, dtype=np.int64)
    shards = sorted(root.glob("shard-*.tar"))
    for tar_path in shards:
        with tarfile.open(tar_path, "r:") as tar:
            for member in tar:
                key, _, suffix = member.name.partition(".")
                if suffix == sf.JSON_MEMBER and member.isfile() and key.isdigit() and int(key) < len(media):
                    record = json.loads(tar.extractfile(member).read())
                    media[int(key)] = geometry.media_tokens(record), geometry.media_tiles(record)
        if on_shard is not None:
            on_shard(len(shards))
    missing = index[media[index, 0] < 0]
    if len(missing):
        raise FileNotFoundError(f"{root}: the shards lack the records of {len(missing)} samples of the length index "
                                f"(e.g. key {int(missing[0]):010d}): rerun `mmdata preprocess`")
    return table.column("text_tokens").to_numpy().astype(np.int64) + media[index, 0], media[index, 1]


def write_plan(root: Path, plan: PackPlan, index: np.ndarray, seed: int, meta: dict,
               columns: dict | None = None) -> Path:
    """The plan file; `columns` (per planned sample, aligned with `index`: numpy or pyarrow
    arrays) are written beside bin, index and tokens (the samples' vision `tiles`; an Emu3
    plan's `key` and `variant`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sizes = np.array([len(b) for b in plan.bins], dtype=np.int64)
    pos = np.concatenate(plan.bins) if plan.bins else np.zeros(0, dtype=np.int64)
    info = {"format": PLAN_FORMAT, "seq_length": plan.seq_length, "seed": seed, "bins": len(plan.bins),
            "samples": int(len(pos)), "tokens": int(plan.lengths.sum()), "efficiency": round(plan.efficiency, 6),
            "over_length": plan.over_length, **meta}
    extra = {name: col.take(pa.array(pos)) if isinstance(col, (pa.Array, pa.ChunkedArray)) else col[pos]
             for name, col in (columns or {}).items()}
    table = pa.table({"bin": np.repeat(np.arange(len(sizes), dtype=np.int64), sizes), "index": index[pos],
                      "tokens": plan.lengths[pos].astype(np.int32), **extra})
    table = table.replace_schema_metadata({"mmdata.pack_plan": json.dumps(info, sort_keys=True)})
    out = plan_path(root, plan.seq_length)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(out)
    return out


def read_plan_info(path: Path) -> dict:
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[b"mmdata.pack_plan"])


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", nargs="?", default=None,
                        help="shards folder written by `mmdata preprocess` (has lengths.parquet); default with "
                             "--recipe: its data.paths[0]")
    parser.add_argument("--recipe", type=Path, default=None, metavar="RECIPE.yaml",
                        help="an mmtrain recipe: a llava-ov one counts image tokens with its geometry "
                             "(model.vision image_size/patch_size, model.max_tiles, model.grid_max, data.video_frames), "
                             "an emu3 one draws the samples' tasks with its data.tasks / p_uncond / uncond_prompt "
                             "(checking tokenizer.path and data.system_prompt against the token shards' length "
                             "index); the plan packs train.seq_length tokens unless --seq-length says otherwise")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a recipe override, as `mmtrain` takes them (repeatable; with --recipe), "
                             "e.g. --set train.seq_length=4096")
    parser.add_argument("--seq-length", type=int, default=None, metavar="N",
                        help="tokens per packed sequence (required without --recipe)")
    for name in GEOMETRY_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, metavar="N",
                            help=f"image geometry: {name} (default: the recipe's, "
                                 f"else {getattr(DEFAULT_GEOMETRY, name)})")
    for name, what in (("cp", "context"), ("tp", "tensor")):
        parser.add_argument(f"--{name}", type=int, default=None, metavar="N",
                            help=f"{what} parallel size the packing report counts CP padding for (default: the "
                                 f"recipe's parallel.{name}, else 1); the plan does not depend on it")
    for name, what in (("dp", "data-parallel ranks"), ("micro_batch_size", "rows per micro-batch (default 1)"),
                       ("global_batch_size", "rows per step, all ranks")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, metavar="N",
                            help=f"vision-aware balancing for training at this step shape: {what} (default: the "
                                 "recipe's when its data.balance is true; else no balancing)")
    parser.add_argument("--tile-tokens", type=float, default=None, metavar="X",
                        help="the cost of one vision tile in language tokens for balancing (default: the recipe "
                             f"model's, from the cost model; else {DEFAULT_TILE_TOKENS:g}, Aquila-VL-2B's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples' order (default 0)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes (default: all CPUs); the plan does not depend on it")
    parser.add_argument("--no-progress", action="store_true", help="no live progress display on stderr")


def run(args: argparse.Namespace) -> int:
    from mmdata.errors import UserError
    from mmdata.readiness import unfinished_job

    root, seq_length, geometry, recipe, (cp, tp), balance = _settings(args)
    args.seq_length = seq_length
    if args.seq_length <= 0:
        raise UserError(f"--seq-length must be positive, got {args.seq_length}")
    if args.jobs is not None and args.jobs <= 0:
        raise UserError(f"--jobs must be positive, got {args.jobs}")
    if (why := unfinished_job(root)) is not None:
        raise UserError(why)
    try:
        table = read_lengths(root)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    from mmdata.preprocess.shard_writer import sha256_file

    manifest = json.loads((root / "manifest.json").read_text()) if (root / "manifest.json").is_file() else {}
    with _Stages(enabled=not args.no_progress) as progress:
        if index_meta(table).get("kind") is not None:  # token shards (mmdata tokenize-images --tokenizer)
            inputs = _token_plan_inputs(root, table, geometry, recipe, args.seed)
        else:
            inputs = _image_plan_inputs(root, table, geometry, progress)
        plan = plan_packing(inputs.lengths, args.seq_length, args.seed, args.jobs or os.cpu_count() or 1,
                            on_chunk=progress.step("pack chunks"))
    meta = {"lengths_sha256": sha256_file(root / LENGTHS_NAME), "manifest_fingerprint": manifest.get("fingerprint"),
            **inputs.meta, "geometry": inputs.geometry.as_dict()}
    balance_line = None
    if balance is not None:
        shape, tile_tokens = balance
        today = plan.vision_balance(inputs.tiles, shape, tile_tokens, balanced=False)
        plan = plan.balanced(inputs.tiles, shape, tile_tokens, args.seed)
        after = plan.vision_balance(inputs.tiles, shape, tile_tokens, balanced=True)
        meta["balance"] = {**shape.as_dict(), "tile_tokens": tile_tokens}
        meta["vision_balance"] = {"today": today.as_dict(), "balanced": after.as_dict()}
        balance_line = (f"vision balance ({shape.describe()}; max/mean vision work per rank per step): "
                        f"today {today.line()} -> balanced {after.line()}")
    report = plan.report(cp, tp)
    meta["packing_report"] = report.as_dict()
    out = write_plan(root, plan, inputs.index, args.seed, meta,
                     {"tiles": inputs.tiles.astype(np.int32), **(inputs.columns or {})})
    print(f"{out}: {len(plan.bins):,} sequences of {args.seq_length:,} tokens for {len(inputs.lengths):,} samples, "
          f"efficiency {plan.efficiency:.2%} ({plan.over_length:,} over length); {inputs.summary}")
    print(f"packing report: {report.line()}")
    if balance_line is not None:
        print(balance_line)
    return 0


@dataclass
class _PlanInputs:
    """What a plan is made from: the planned samples' lengths, vision tiles and global indices, extra plan
    columns, metadata, the geometry it records, and a summary for the command's output line."""

    lengths: np.ndarray
    tiles: np.ndarray  # the vision tiles each planned sample's media cost the tower (vision-aware balancing)
    index: np.ndarray
    geometry: "PlanGeometry | Emu3PlanGeometry"
    summary: str
    meta: dict
    columns: dict | None = None


def _image_plan_inputs(root: Path, table, geometry: "PlanGeometry | Emu3PlanGeometry | None", progress) -> _PlanInputs:
    """Image shards (`mmdata preprocess`): the length index's totals, or the image tokens
    recounted with another geometry."""
    from mmdata.errors import UserError

    if not isinstance(geometry, PlanGeometry | None):
        raise UserError(f"{root} holds image shards (`mmdata preprocess`); the recipe's family plans token shards")
    geometry = geometry or DEFAULT_GEOMETRY
    if geometry == DEFAULT_GEOMETRY and VISION_TILES in table.column_names:  # what the length index counted
        lengths = table.column("total_tokens").to_numpy().astype(np.int64)
        tiles = table.column(VISION_TILES).to_numpy().astype(np.int64)
    else:
        if geometry == DEFAULT_GEOMETRY:
            print(f"note: {root / LENGTHS_NAME} predates its {VISION_TILES} column (vision tiles per sample): "
                  "counting them from the shards' records", file=sys.stderr)
        try:
            lengths, tiles = recount_media(root, table, geometry, on_shard=progress.step("recount shards"))
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
    text = (table.schema.metadata or {}).get(b"mmdata.text_tokens", b"").decode()
    return _PlanInputs(lengths, tiles, table.column("index").to_numpy(), geometry,
                       f"image geometry {geometry.flags()}", {"text_tokens": text})


def _token_plan_inputs(root: Path, table, geometry: "PlanGeometry | Emu3PlanGeometry | None", recipe,
                       seed: int) -> _PlanInputs:
    """Emu3 token shards: each sample's variant drawn and its length for it (plan_lengths.py);
    samples the encoder would skip in their variant are left out (`skipped`). No vision tower
    encodes their images (they are tokens already): no tiles."""
    from mmdata.energon_loaders.emu3 import plan_lengths as e3
    from mmdata.errors import UserError

    have = index_meta(table)
    if have.get("kind") != e3.KIND:
        raise UserError(f"{root}/{LENGTHS_NAME}: a length index of unknown kind {have.get('kind')!r}")
    if geometry is None:  # no recipe: the default task settings, with the index's tokenizer and prompt
        geometry = e3.Emu3PlanGeometry(have["tokenizer_sha256"], have["system_prompt"])
    elif not isinstance(geometry, e3.Emu3PlanGeometry):
        raise UserError(f"{root} holds Emu3 token shards: plan them with an emu3 --recipe (or none); the image "
                        "geometry options do not apply")
    for name, what, flag in (("tokenizer_sha256", "tokenizer", "--tokenizer (the recipe's tokenizer.path)"),
                             ("system_prompt", "system prompt", "--system-prompt (the recipe's data.system_prompt)")):
        if getattr(geometry, name) != have[name]:
            raise UserError(f"{root}'s length index was counted with another {what} than the recipe's ({name} "
                            f"{have[name]!r:.40}, recipe: {getattr(geometry, name)!r:.40}): rerun "
                            f"`mmdata tokenize-images` with {flag}")
    uncond = e3.uncond_prompt_tokens(recipe.tokenizer.path, geometry.uncond_prompt) if recipe is not None else 0
    variant, lengths = e3.draw_variants(table, geometry, seed, uncond)
    keep = lengths != e3.UNENCODABLE
    n = np.bincount(variant[keep], minlength=3)
    summary = (f"Emu3 tasks: {n[e3.UNDERSTAND]:,} understanding, {n[e3.GENERATE] + n[e3.GENERATE_UNCOND]:,} "
               f"generation ({n[e3.GENERATE_UNCOND]:,} caption dropped), {int((~keep).sum()):,} skipped")
    return _PlanInputs(lengths[keep], np.zeros(int(keep.sum()), np.int64), table.column("index").to_numpy()[keep],
                       geometry, summary,
                       {"skipped": int((~keep).sum())},
                       {"key": table.column("key").filter(keep), "variant": variant[keep]})


class _Stages:
    """Live progress of pack-plan's stages (the job's own progress display, one bar each)."""

    def __init__(self, enabled: bool):
        from mmdata.preprocess.progress import JobProgress

        self.job = JobProgress(enabled)

    def __enter__(self) -> "_Stages":
        self.job.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.__exit__(*exc)

    def step(self, name: str) -> Callable[[int], None]:
        """A callback advancing stage `name` by one of `total` (the stage starts at its first call)."""
        def advance(total: int) -> None:
            if name not in self.job.tasks:
                self.job.stage(name, total)
            self.job.advance(name)
        return advance


def _settings(args: argparse.Namespace):
    """(shards dir, seq_length, geometry, recipe, (cp, tp) of the report, (step shape, tile cost)
    to balance for or None) from the flags, else the recipe, else the defaults (geometry None:
    what the length index counted with)."""
    from mmdata.errors import UserError

    overrides = list(args.overrides)
    if overrides and args.recipe is None:
        raise UserError(f"--set {' '.join(overrides)}: recipe overrides need --recipe RECIPE.yaml")
    base, seq_length, root, recipe = None, args.seq_length, args.dir, None
    cp, tp = getattr(args, "cp", None), getattr(args, "tp", None)
    shape = {k: getattr(args, k, None) for k in ("dp", "micro_batch_size", "global_batch_size")}
    tile_tokens = getattr(args, "tile_tokens", None)
    if args.recipe is not None:
        from mmtrain.config.load import load_recipe

        recipe = load_recipe(args.recipe, overrides)
        try:
            base = recipe_geometry(recipe)
        except FileNotFoundError as e:  # its tokenizer.path
            raise UserError(f"--recipe {args.recipe}: {e}") from None
        if base is None:
            raise UserError(f"--recipe {args.recipe}: family {recipe.family} has nothing to plan with "
                            "(pack-plan plans LLaVA-OV image shards and Emu3 token shards)")
        seq_length = seq_length if seq_length is not None else recipe.train.seq_length
        if root is None and recipe.data.paths:
            root = Path(recipe.data.paths[0])
        cp = cp if cp is not None else recipe.parallel.cp
        tp = tp if tp is not None else recipe.parallel.tp
        if getattr(recipe.data, "balance", False) or shape["dp"] is not None:
            mine = {"dp": recipe.parallel.dp, "micro_batch_size": recipe.train.micro_batch_size,
                    "global_batch_size": recipe.train.global_batch_size}
            shape = {k: v if v is not None else mine[k] for k, v in shape.items()}
            if tile_tokens is None:
                from mmtrain import registry
                from mmtrain.models.flops import tile_token_cost

                tile_tokens = tile_token_cost(registry.get_family(recipe.family).model_shapes(recipe.model))
    if root is None:
        raise UserError("give the shards folder DIR (or --recipe with data.paths)")
    if seq_length is None:
        raise UserError("give --seq-length N (or --recipe, whose train.seq_length is used)")
    given = {k: getattr(args, k) for k in GEOMETRY_FIELDS if getattr(args, k) is not None}
    # (a recipe's tile cost may be 0: a family without a vision tower balances on tokens alone)
    asked = {**given, "cp": cp, "tp": tp, **shape, "tile_tokens": getattr(args, "tile_tokens", None)}
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in asked.items() if v is not None and v <= 0]
    if bad:
        raise UserError(f"{', '.join(bad)}: must be positive")
    if given and not isinstance(base, PlanGeometry | None):
        raise UserError(f"--{next(iter(given)).replace('_', '-')}: image geometry options do not apply to the "
                        f"recipe's family ({recipe.family})")
    geometry = PlanGeometry(**{**(base or DEFAULT_GEOMETRY).as_dict(), **given}) if given else base
    return root, seq_length, geometry, recipe, (cp or 1, tp or 1), _balance(shape, tile_tokens)


def _balance(shape: dict, tile_tokens: float | None) -> tuple["StepShape", float] | None:
    """The step shape and tile cost to balance for, from --dp/--micro-batch-size/--global-batch-size
    (--dp and --global-batch-size go together; the micro-batch defaults to 1)."""
    from mmdata.energon_loaders.balance import StepShape
    from mmdata.errors import UserError

    if shape["dp"] is None and shape["global_batch_size"] is None:
        if shape["micro_batch_size"] is not None or tile_tokens is not None:
            raise UserError("--micro-batch-size/--tile-tokens balance a plan for a step shape: give --dp and "
                            "--global-batch-size with them")
        return None
    if shape["dp"] is None or shape["global_batch_size"] is None:
        raise UserError("vision-aware balancing needs the step shape: give --dp N and --global-batch-size N "
                        "(and --micro-batch-size N, default 1), or --recipe with data.balance: true")
    try:
        step = StepShape(shape["dp"], shape["micro_batch_size"] or 1, shape["global_batch_size"])
    except ValueError as e:
        raise UserError(f"--dp/--micro-batch-size/--global-batch-size: {e}") from None
    return step, float(tile_tokens if tile_tokens is not None else DEFAULT_TILE_TOKENS)


def main(argv: list[str] | None = None) -> int:
    from mmdata.cli import main as mmdata_main

    return mmdata_main(["pack-plan", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
