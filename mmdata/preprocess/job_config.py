"""What `mmdata preprocess` is asked to do: its options, the curation flags parsed and checked
before any work starts, the job description its fingerprint is taken of, and the driver's small
decisions from per-group counts (shard size, mix targets, why nothing would be written)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmdata import shard_format as sf
from mmdata.errors import UserError
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.curation import dedup
from mmdata.preprocess.curation.filters import FilterError, FilterRule, parse_filters
from mmdata.preprocess.curation.mix import MixError, MixSpec, factors, group_targets, parse_mix
from mmdata.preprocess.curation.terms import unmatched
from mmdata.preprocess.loss_check import DEFAULT_MAX_FRACTION
from mmdata.preprocess.validation import ValidationConfig
from mmdata.shard_job.lengths import tokenizer_fingerprint
from mmdata.shard_job.manifest import Counts
from mmdata.units import plural

TOOL = "mmdata preprocess"
DEFAULT_TARGET_SHARD_BYTES = 256 << 20


class PreprocessError(UserError):
    """A problem with the job's inputs/outputs that the user must fix (printed, exit 2)."""


@dataclass
class PreprocessConfig:
    dataset: str
    inputs: list[Path]
    output: Path
    seed: int = 0
    samples_per_shard: int | None = None  # None: sized for ~target_shard_bytes per shard
    image_root: Path | None = None
    address: str | None = None
    num_cpus: int | None = None
    overwrite: bool = False
    num_buckets: int | None = None  # None: derived from input size (never from the worker count)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES
    progress: bool = True
    keep_work_dir: bool = False
    # Stop when one quarantine reason takes more than this share of the first records (1.0: never).
    # Not part of the fingerprint: it never changes the output, and a rerun that relaxes it
    # continues the stopped job.
    max_quarantine_fraction: float = DEFAULT_MAX_FRACTION
    # Curation (docs/preprocess.md "Curation"): --filter EXPR..., --dedup phash[:D],
    # --dedup-scope record|image, --mix FILE.yaml|source=weight,...
    filters: list[str] = field(default_factory=list)
    dedup: str | None = None
    dedup_scope: str = "record"
    mix: str | None = None
    tokenizer: Path | None = None  # exact text tokens in the length index (else an estimate)
    length_index: bool = True  # write lengths.parquet (--no-length-index: skip its token counting)


@dataclass(frozen=True)
class Curation:
    """The curation options, parsed and checked before any work starts."""

    filters: tuple[FilterRule, ...] = ()
    dedup_distance: int | None = None
    dedup_scope: str = "record"
    mix: MixSpec | None = None
    tokenizer_sha256: str | None = None

    def to_json(self) -> dict:
        return {
            "filters": [r.expr for r in self.filters],
            "dedup": None
            if self.dedup_distance is None
            else {
                "method": "phash",
                "distance": self.dedup_distance,
                "scope": self.dedup_scope,
                "bands": len(dedup.band_masks(self.dedup_distance)),
            },
            "mix": self.mix.to_json() if self.mix else None,
        }


def parse_curation(cfg: PreprocessConfig) -> Curation:
    """All curation flags checked up front: a malformed one is exit 2 before any work."""
    try:
        rules = tuple(parse_filters(list(cfg.filters)))
        distance = dedup.parse_dedup(cfg.dedup) if cfg.dedup else None
        if cfg.dedup_scope not in dedup.SCOPES:
            raise ValueError(f"--dedup-scope must be one of {dedup.SCOPES}")
        mix = parse_mix(cfg.mix) if cfg.mix else None
        tok = tokenizer_fingerprint(cfg.tokenizer) if cfg.tokenizer else None
    except (FilterError, MixError, ValueError, FileNotFoundError) as e:
        raise PreprocessError(str(e)) from None
    if cfg.tokenizer:  # loadable here, not only in the scan tasks
        load_local_tokenizer(cfg.tokenizer, "--tokenizer")
    return Curation(rules, distance, cfg.dedup_scope, mix, tok)


def job_description(cfg: PreprocessConfig, cur: Curation, units: list[InputUnit]) -> dict:
    """Everything the output depends on: its fingerprint is the job's identity, and a refusal
    names the entries that differ (the manifest keeps it as `job`, `inputs` apart)."""
    inputs = [{"path": u.path, "rel": u.rel, "size": u.size, "mtime_ns": u.mtime_ns} for u in units]
    return {
        "format_version": sf.FORMAT_VERSION,
        "dataset": cfg.dataset,
        "inputs": inputs,
        "seed": cfg.seed,
        "samples_per_shard": cfg.samples_per_shard,
        "target_shard_bytes": cfg.target_shard_bytes,
        "image_root": str(cfg.image_root) if cfg.image_root else None,
        "validation": asdict(cfg.validation),
        "curation": cur.to_json(),
        "tokenizer": cur.tokenizer_sha256,
        "length_index": cfg.length_index,
    }


def manifest_job(manifest: dict) -> dict | None:
    return {**manifest["job"], "inputs": manifest.get("inputs")} if isinstance(manifest.get("job"), dict) else None


def nothing_to_write(counts: Counts, files: int) -> str:
    """Why a job that would write 0 samples stops (nothing is written)."""
    c = counts.to_json()
    if c["read"] == 0:
        return f"no record to write: 0 records read from {plural(files, 'input file')}"
    why = (
        [
            f"{c['quarantined']:,} quarantined ("
            + ", ".join(f"{r} {n:,}" for r, n in sorted(c["by_reason"].items(), key=lambda kv: -kv[1])[:3])
            + ")"
        ]
        if c["quarantined"]
        else []
    )
    why += [f"{c[k]:,} {k.replace('_', ' ')}" for k in ("filtered", "duplicates", "mixed_out") if c.get(k)]
    return (
        f"no sample to write: of {plural(c['read'], 'record')} read, {', '.join(why)}; nothing was written. "
        "Check --dataset, --image-root and the curation flags"
    )


def auto_samples_per_shard(valid_bytes: int, records: int, target_bytes: int) -> int:
    """Samples per shard for ~target_bytes shards, from the kept records' average size."""
    if records == 0:
        return 1
    per_sample = valid_bytes / records + 2048  # tar headers + padding
    return int(max(1, min(1_000_000, round(target_bytes / per_sample))))


def mix_plan(spec: MixSpec, available: dict[str, int]) -> tuple[dict[str, int], dict[str, float]]:
    """(targets, factors) per mix group; listed groups absent from the data count as 0."""
    groups = {**{g: 0 for g, _ in spec.weights if g != "*"}, **available}
    targets = group_targets(spec, groups)
    return targets, factors(targets, groups)


def unmatched_terms(cfg: PreprocessConfig, cur: Curation, kind: str, known: set[str]) -> str | None:
    """The error for --mix weights and --filter values on `kind` (source or subset) that name
    nothing in the input (they would drop its records silently); None when all match."""
    problems = []
    if cur.mix is not None and cur.mix.by == kind and (bad := [g for g in cur.mix.listed() if g not in known]):
        problems.append(unmatched(f"--mix {cfg.mix!r}", kind, bad, known))
    for rule in cur.filters:
        if rule.field == kind and (bad := [v for v in rule.values() if v not in known]):
            problems.append(unmatched(f"--filter {rule.expr!r}", kind, bad, known))
    return "; ".join(problems) or None
