"""The two Ray stages of `mmdata tokenize-images`, as plain code (the driver wraps them with
`ray.remote`). Each is idempotent and writes atomically under the work folder with its marker
last, so a retried or resumed chunk gives the same bytes.

- TokenizeWorker (an actor: loads the VQ once) runs tokenize_chunk: decode, resize
  (Emu3ImageProcessor) and VQ-encode the images of a fixed run of samples of one input shard;
  spill the output samples' members and quarantine lines.
- write_token_shard: concatenate a shard's chunks into the output shard (+ energon .tar.idx and,
  with --tokenizer, the shard's part of the length index: vision_tokens/lengths.py).

A chunk's output depends only on its samples, the VQ model and the options (never on which
worker ran it, or how many), and chunks are fixed runs of `chunk_samples` samples, so the
shards are byte-identical whatever the number of workers.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from mmdata import shard_format as sf
from mmdata.energon_loaders.emu3 import token_format
from mmdata.energon_loaders.emu3.plan_lengths import sample_lengths
from mmdata.energon_loaders.emu3.tasks import DEFAULT_SYSTEM_PROMPT, Emu3Tasks
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.packing.emu3_geometry import UNENCODABLE
from mmdata.shard_job.energon_meta import INDEX_PART, write_index_part, write_tar_index
from mmdata.shard_job.manifest import Counts
from mmdata.shard_job.quarantine import quarantine_line
from mmdata.shard_job.shard_writer import SampleMembers, sha256_file, shard_work_file, write_shard
from mmdata.shard_job.shard_samples import chunk_samples
from mmdata.stage_runner import CPU_KEY
from mmdata.vision_tokens.lengths import shard_part
from mmdata.vision_tokens.vq import VisionTokenizer, set_deterministic_torch


@dataclass(frozen=True)
class TokenizeOptions:
    """What every worker needs (small: shipped to each actor once)."""

    input_dir: str
    work: str
    vq_dir: str
    vq_fingerprint: str  # workers refuse weights that changed after the driver fingerprinted them
    image_area: int | None
    device: str  # "cpu" | "cuda"
    batch_size: int  # same-size images per VQ forward
    threads: int  # torch threads per worker
    text_tokenizer: str | None = None  # Emu3 text tokenizer folder: count each sample's lengths (lengths.py)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # ... with this system prompt


@dataclass(frozen=True)
class ChunkSpec:
    shard: str  # input (and output) shard name
    index: int  # chunk number within the shard
    start: int  # sample range [start, stop) within the shard
    stop: int


def chunk_file(work: str | Path, shard: str, index: int, suffix: str) -> Path:
    """One of a chunk's work files: bin (member bytes), quarantine.jsonl, json (done-marker)."""
    return Path(work) / "chunks" / f"{shard}.c{index:05d}.{suffix}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the VQ, once per worker

#: VisionTokenizer loads in this process (what `TokenizeWorker.vq_loads` reports: tests and the
#: manifest show it stays 1 per worker, however many chunks the worker tokenized).
_VQ_LOADS = 0


def load_vision_tokenizer(opts: TokenizeOptions):
    """Load the VQ model (seconds for a real one), refusing weights that changed after the
    driver fingerprinted them."""
    global _VQ_LOADS
    set_deterministic_torch(opts.device, opts.threads)
    vt = VisionTokenizer(opts.vq_dir, opts.image_area, opts.device)
    _VQ_LOADS += 1
    if vt.fingerprint != opts.vq_fingerprint:
        raise RuntimeError(
            f"{opts.vq_dir}: the VQ weights changed while the job ran "
            f"(fingerprint {vt.fingerprint[:12]} != {opts.vq_fingerprint[:12]})"
        )
    return vt


def vq_loads_in_process() -> int:
    return _VQ_LOADS


def worker_file(work: str | Path, index: int, host: str, pid: int) -> Path:
    """Written by each process of worker `index` once its VQ is loaded: how the driver counts
    loads and restarts, even of a process that died before it finished a chunk."""
    return Path(work) / "workers" / f"w{index:04d}.{host}.{pid}.json"


class TokenizeWorker:
    """One tokenizing worker (the driver makes it a Ray actor: one per CPU, or per GPU share).

    Why an actor: Ray runs every GPU task in a fresh process (`max_calls=1`), so a model cached
    by a task is lost after each chunk. An actor loads the VQ once, in its constructor, and
    tokenizes every chunk streamed to it with that one model. Ray reruns the constructor in a
    new process when the worker is restarted after a crash."""

    def __init__(self, opts: TokenizeOptions, index: int):
        self.opts, self.index = opts, index
        self.vt = load_vision_tokenizer(opts)
        self.tasks = load_text_tasks(opts)
        self.process = {"worker": index, "host": socket.gethostname(), "pid": os.getpid()}
        path = worker_file(opts.work, index, self.process["host"], self.process["pid"])
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, json.dumps(self.process).encode())

    def tokenize(self, spec: ChunkSpec) -> dict:
        """The chunk's counts, which process did it with how many VQ loads so far (1, unless
        something reloads the model per chunk), and the CPU it took (`run.task_cpu_s`, as the
        runner's tasks report theirs)."""
        c0 = time.process_time()
        result = tokenize_chunk(spec, self.opts, self.vt, self.tasks)
        return {**result, **self.process, "vq_loads": vq_loads_in_process(), CPU_KEY: time.process_time() - c0}


def load_text_tasks(opts: TokenizeOptions):
    """The Emu3 task renderer the loader uses (tasks.py) over the text tokenizer, to count each
    sample's lengths; None without --tokenizer."""
    if opts.text_tokenizer is None:
        return None
    return Emu3Tasks(load_local_tokenizer(opts.text_tokenizer, "--tokenizer"), opts.system_prompt)


def record_lengths(tasks, record: dict | None, grids: list[np.ndarray]) -> list[int]:
    """A written record's lengths per task, as the loader will encode it (plan_lengths.py)."""
    conversations = (record or {}).get("conversations")
    if not isinstance(conversations, list) or not all(isinstance(t, dict) for t in conversations):
        return [UNENCODABLE, UNENCODABLE, 0]  # the loader cannot read it as a conversation
    return list(sample_lengths(tasks, conversations, grids))


class _Rejected(Exception):
    """A record the job cannot tokenize: a machine-readable reason and a detail (made
    deterministic by `quarantine_line`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _decode_image(data: bytes, name: str):
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # noqa: BLE001 - any decoder error rejects the record
        raise _Rejected("image_decode_error", f"{name}: {type(e).__name__}: {e}") from None
    return img


# ----------------------------------------------------------------------------- stage 1


@dataclass
class _Pending:
    """A record whose images are waiting for the VQ."""

    key: str
    record_json: bytes
    sources: list[str]
    pixels: list[list[int]]
    grids: list[np.ndarray | None]
    error: _Rejected | None = None


class _Encoder:
    """Batches preprocessed images by size (at most `batch_size` per VQ forward, filled in
    sample order, so the batches are a function of the chunk alone)."""

    def __init__(self, vt, batch_size: int):
        self.vt, self.batch_size = vt, batch_size
        self.waiting: dict[tuple[int, ...], list[tuple[_Pending, int, np.ndarray]]] = {}

    def add(self, rec: _Pending, i: int, pixels: np.ndarray) -> None:
        group = self.waiting.setdefault(pixels.shape, [])
        group.append((rec, i, pixels))
        if len(group) >= self.batch_size:
            self._run(self.waiting.pop(pixels.shape))

    def flush(self) -> None:
        for shape in list(self.waiting):
            self._run(self.waiting.pop(shape))

    def _run(self, group: list[tuple[_Pending, int, np.ndarray]]) -> None:
        try:
            grids = self.vt.encode([p for _, _, p in group])
        except Exception as e:  # noqa: BLE001 - e.g. out of device memory: retry one by one
            if len(group) > 1:
                for item in group:
                    self._run([item])
                return
            rec, i, _ = group[0]
            rec.error = _Rejected("vq_error", f"{rec.sources[i]}: {type(e).__name__}: {e}")
            return
        for (rec, i, _), grid in zip(group, grids):
            rec.grids[i] = grid


def finished_chunk(spec: ChunkSpec, work: str | Path) -> dict | None:
    """A chunk's counts when a previous run finished it (read by the driver: no worker needed)."""
    marker = chunk_file(work, spec.shard, spec.index, "json")
    if not marker.exists():
        return None
    return {**json.loads(marker.read_text())["counts"], "resumed": True}


def tokenize_chunk(spec: ChunkSpec, opts: TokenizeOptions, vt, tasks=None) -> dict:
    """Tokenize the images of samples [start, stop) of one input shard with the loaded VQ `vt`
    (and with `tasks`, load_text_tasks, count each written sample's lengths). Returns the chunk's
    counts; its output samples, their lengths and quarantine lines go to the work folder."""
    if (done := finished_chunk(spec, opts.work)) is not None:
        return done
    marker = chunk_file(opts.work, spec.shard, spec.index, "json")
    path = Path(opts.input_dir) / spec.shard
    samples = chunk_samples(path, spec.start, spec.stop)
    if len(samples) != spec.stop - spec.start:
        raise IOError(f"{path}: has fewer samples than planned (input changed?)")
    encoder = _Encoder(vt, opts.batch_size)
    counts, stats = Counts(), {"images": 0, "visual_tokens": 0, "text_only": 0}
    qlines: list[str] = []
    records: list[_Pending] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for key, members in samples:
            parts = {suffix: os.pread(fd, size, offset) for suffix, offset, size in members}
            records.append(_prepare(key, parts, vt, encoder))
    finally:
        os.close(fd)
    encoder.flush()
    blob = bytearray()
    index: list[list] = []
    lengths: list[list[int]] = []
    for rec in records:
        record = _record_or_none(rec.record_json)
        source = (record or {}).get("source", "") or ""
        if rec.error is not None:
            rid = str((record or {}).get("id", rec.key))
            qlines.append(quarantine_line(rid, f"{spec.shard}:{rec.key}", rec.error.reason, rec.error.detail))
            counts.add_record(source, False, rec.error.reason)
            continue
        members = [(sf.JSON_MEMBER, rec.record_json)]
        infos = []
        for src, pixels, grid in zip(rec.sources, rec.pixels, rec.grids):
            name = token_format.grid_member_name(src)
            members.append((name, token_format.encode_grid(grid, vt.config["codebook_size"])))
            infos.append(token_format.GridInfo(name, src, int(grid.shape[0]), int(grid.shape[1]), pixels))
            stats["visual_tokens"] += grid.size
        members.append((token_format.VQ_JSON_MEMBER, token_format.encode_vq_json(infos)))
        stats["images"] += len(infos)
        stats["text_only"] += not infos
        entry = []
        for suffix, data in members:
            entry.append([suffix, len(blob), len(data)])
            blob += data
        index.append([rec.key, entry])
        if tasks is not None:
            lengths.append(record_lengths(tasks, record, rec.grids))
        counts.add_record(source, True, nbytes=sum(len(d) for _, d in members))
    _write_atomic(chunk_file(opts.work, spec.shard, spec.index, "bin"), bytes(blob))
    _write_atomic(
        chunk_file(opts.work, spec.shard, spec.index, "quarantine.jsonl"), "".join(q + "\n" for q in qlines).encode()
    )
    result = {**counts.to_json(), **stats}
    _write_atomic(
        marker,
        json.dumps(
            {"counts": result, "samples": index, **({"lengths": lengths} if tasks is not None else {})}
        ).encode(),
    )
    return {**result, "resumed": False}


def _record_or_none(record_json: bytes) -> dict | None:
    try:
        record = json.loads(record_json)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _prepare(key: str, parts: dict[str, bytes], vt, encoder: _Encoder) -> _Pending:
    """Check one record and queue its images for the VQ; a rejected record carries its reason."""
    record_json = parts.get(sf.JSON_MEMBER, b"")
    record = _record_or_none(record_json)
    rec = _Pending(key, record_json, [], [], [])
    if record is None or not isinstance(record.get("images", []), list):
        rec.error = _Rejected("record_malformed", f"{key}: no readable {sf.JSON_MEMBER} record")
        return rec
    if record.get("video"):
        rec.error = _Rejected(
            "video_not_supported", f"{record['video']}: video records are not tokenized (images only)"
        )
        return rec
    rec.sources = [str(s) for s in record.get("images") or []]
    try:
        prepared = []
        for name in rec.sources:
            if name not in parts:
                raise _Rejected("image_missing", f"{name}: no such member in the sample")
            img = _decode_image(parts[name], name)
            try:
                pixels = vt.preprocess(img)
            except ValueError as e:  # Emu3ImageProcessor's own refusal, e.g. aspect ratio over 200
                raise _Rejected("image_unsupported_size", f"{name} ({img.width}x{img.height}): {e}") from None
            except Exception as e:  # noqa: BLE001 - e.g. an unusual mode the processor cannot convert
                raise _Rejected("image_decode_error", f"{name}: {type(e).__name__}: {e}") from None
            prepared.append(pixels)
    except _Rejected as r:
        rec.error = r
        return rec
    rec.pixels = [[int(p.shape[1]), int(p.shape[2])] for p in prepared]
    rec.grids = [None] * len(prepared)
    for i, pixels in enumerate(prepared):
        encoder.add(rec, i, pixels)
    return rec


# ----------------------------------------------------------------------------- stage 2


def write_token_shard(shard: str, num_chunks: int, work: str, out: str, lengths: bool = False) -> dict:
    """Write one output shard from its chunks (or keep it if a previous run wrote it), and with
    `lengths` its part of the length index."""
    w, o = Path(work), Path(out)
    path, marker = o / shard, shard_work_file(w, shard, "json")
    part_path, lengths_path = shard_work_file(w, shard, INDEX_PART), shard_work_file(w, shard, "lengths.json")
    if marker.exists():
        done = json.loads(marker.read_text())
        if done["samples"] == 0 or (
            path.exists()
            and part_path.exists()
            and (lengths_path.exists() or not lengths)
            and sha256_file(path) == done["sha256"]
        ):
            return {**done, "resumed": True}
    items, keys, sample_lengths = [], [], []
    for c in range(num_chunks):
        chunk = json.loads(chunk_file(w, shard, c, "json").read_text())
        blob = chunk_file(w, shard, c, "bin").read_bytes()
        for key, members in chunk["samples"]:
            items.append(SampleMembers(key, [(suffix, blob[off : off + size]) for suffix, off, size in members]))
            keys.append(key)
        sample_lengths += chunk.get("lengths", [])
    if not items:  # every record quarantined: no shard (energon would list an empty one)
        path.unlink(missing_ok=True)
        done = {"name": shard, "samples": 0, "bytes": 0, "sha256": ""}
    else:
        result, layout = write_shard(path, items)
        write_tar_index(path, layout)
        write_index_part(part_path, layout)
        if lengths:
            _write_atomic(lengths_path, shard_part(keys, sample_lengths))
        done = asdict(result)
    _write_atomic(marker, json.dumps(done).encode())
    return {**done, "resumed": False}
