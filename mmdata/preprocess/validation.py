"""Record validation: JSON schema, conversation shape, every referenced image present and
fully decodable (with a decompression-bomb guard), `<image>` placeholders consistent with the
images. Produces either a normalised SampleRecord (as JSON text + media refs) or a quarantine
reason code. Pure functions of the record bytes, so results never depend on scheduling."""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass, field

from PIL import Image, ImageFile

from mmdata import fast_json
from mmdata.preprocess import decode_check
from mmdata.preprocess.adapters.base import MediaRef, RawRecord
from mmdata.preprocess.adapters.media_resolution import Resolution, basename, resolve, weakest
from mmdata.shard_format import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, SampleRecord, image_member_name, video_member_name

# Reason codes (machine-readable; documented in docs/preprocess.md).
REASONS = (
    "json_missing",
    "json_malformed",
    "schema_invalid",
    "conversation_malformed",
    "image_missing",
    "image_empty",
    "image_truncated",
    "image_undecodable",
    "image_too_large",
    "placeholder_mismatch",
    "video_missing",
    "video_empty",
    "video_undecodable",
    "video_too_large",
    "input_truncated",
    "input_unreadable",
    "conversation_too_long",
    "media_outside_input",
    "unsafe_member_name",
    "duplicate_key",
)
ROLES = {"human", "gpt", "system"}
FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff", "MPO": "jpg"}
META_FIELDS = ("ram++_tags", "ram++_tags_score", "phash", "qw2vl_loss")

ImageFile.LOAD_TRUNCATED_IMAGES = False


@dataclass(frozen=True)
class ValidationConfig:
    max_image_pixels: int = 89_478_485  # Pillow's MAX_IMAGE_PIXELS default
    max_image_bytes: int = 256 << 20
    max_images_per_record: int = 64
    max_video_bytes: int = 1 << 30
    max_video_frames: int = 100_000
    # Far beyond any real instruction sample (Infinity-MM's longest are a few dozen turns and
    # tens of kB): a record past these is broken or hostile, and would only be cut by the loader.
    max_turns: int = 1_000
    max_conversation_chars: int = 4_000_000


@dataclass
class Valid:
    record_json: str  # the normalised SampleRecord, serialised
    media: list[tuple[MediaRef, str]]  # (where the bytes are, member suffix e.g. "img00.jpg")
    source: str
    record: dict  # the normalised SampleRecord (what record_json holds)
    media_rule: str | None  # how its media were found (media_resolution.RULES; None: no media)
    unreferenced_members: int  # own image members that no entry used
    image_bytes: list[bytes]  # the images' bytes, when validate(keep_image_bytes=True)


@dataclass
class Invalid:
    reason: str
    detail: str
    id: str
    source: str
    extra: dict = field(default_factory=dict)


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def quiet_pillow_bomb_warning() -> None:
    """Pillow's own decompression-bomb check warns above its MAX_IMAGE_PIXELS; `_guard_pixels`
    applies the job's --max-image-pixels right after the header is read, so that warning adds
    nothing. It is ignored by a filter (set again by each scan task: a `catch_warnings()` around
    an import drops it), not turned into an error by a `catch_warnings()` per image: that saves
    and restores the process's whole filter list around every decode, undoing filters other
    threads add meanwhile (when the driver scanned in a thread while it imported Ray, a lost
    filter of `requests` printed urllib3's SOCKS warning)."""
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


quiet_pillow_bomb_warning()


def _png_fast_ok(img: Image.Image) -> bool:
    """A plain (non-interlaced, non-animated) PNG: validated by `check_png_stream`."""
    return not img.info.get("interlace") and not getattr(img, "is_animated", False)


def _guard_pixels(w: int, h: int, name: str, cfg: ValidationConfig) -> None:
    if w * h > cfg.max_image_pixels:
        raise _Reject("image_too_large", f"{name}: {w}x{h} = {w * h} px > {cfg.max_image_pixels}")


def _open_and_check(data: bytes, name: str, cfg: ValidationConfig) -> tuple[str, int, int, str]:
    """(format, width, height, mode) after the format's full decode check; raises OSError.
    Plain JPEGs, plain PNGs and still WebPs never reach Pillow (its Python header parsing would
    cost as much as the check); everything else, and every JPEG or PNG the fast path does not
    take, does."""
    jpeg_cheap = decode_check.is_jpeg(data) and decode_check.jpeg_cheap_check_tested(data)
    if jpeg_cheap and (header := decode_check.jpeg_header(data)):
        _guard_pixels(header[0], header[1], name, cfg)
        if decode_check.jpeg_decodes_cleanly(data):
            return ("JPEG", *header)
    elif decode_check.is_webp(data):
        w, h, has_alpha, animated = decode_check.webp_features(data)
        if not animated:
            _guard_pixels(w, h, name, cfg)
            decode_check.check_webp(data, w, h, has_alpha)
            return "WEBP", w, h, "RGBA" if has_alpha else "RGB"
    elif header := decode_check.png_header(data):
        w, h, mode = header
        _guard_pixels(w, h, name, cfg)
        decode_check.check_png_stream(data, w, h)
        return "PNG", w, h, mode
    img = Image.open(io.BytesIO(data))
    w, h = img.size
    _guard_pixels(w, h, name, cfg)
    fmt, mode = img.format or "", img.mode
    if fmt == "JPEG" and jpeg_cheap:
        decode_check.check_jpeg_with_pillow(img)
    elif fmt == "PNG" and _png_fast_ok(img):
        decode_check.check_png_stream(data, w, h)
    else:
        img.load()
    return fmt, w, h, mode


def check_image(data: bytes, name: str, cfg: ValidationConfig) -> tuple[str, int, int, str]:
    """Header + full decode check. Returns (ext, width, height, mode) or raises _Reject."""
    if len(data) == 0:
        raise _Reject("image_empty", f"{name}: 0 bytes")
    if len(data) > cfg.max_image_bytes:
        raise _Reject("image_too_large", f"{name}: {len(data)} bytes > {cfg.max_image_bytes}")
    try:
        fmt, w, h, mode = _open_and_check(data, name, cfg)
    except _Reject:
        raise
    except Image.DecompressionBombError as e:  # (over twice Pillow's limit, before our guard)
        raise _Reject("image_too_large", f"{name}: {e}") from None
    except OSError as e:
        msg = str(e)
        reason = (
            "image_truncated"
            if "truncated" in msg or "broken data stream" in msg or "premature" in msg.lower()
            else "image_undecodable"
        )
        raise _Reject(reason, f"{name}: {msg}") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad image, not a crash
        raise _Reject("image_undecodable", f"{name}: {type(e).__name__}: {e}") from None
    ext = FORMAT_EXT.get(fmt)
    if ext is None:
        raise _Reject("image_undecodable", f"{name}: unsupported format {fmt!r}")
    return ext, w, h, mode


def check_video(data: bytes, name: str, cfg: ValidationConfig) -> tuple[int, int, int]:
    """Container + full decode of the first video stream (PyAV). Returns (width, height, frames)."""
    if len(data) == 0:
        raise _Reject("video_empty", f"{name}: 0 bytes")
    if len(data) > cfg.max_video_bytes:
        raise _Reject("video_too_large", f"{name}: {len(data)} bytes > {cfg.max_video_bytes}")
    import av  # (a heavy import, needed only for a record with a video)

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise _Reject("video_undecodable", f"{name}: no video stream")
            stream = container.streams.video[0]
            w, h, frames = stream.codec_context.width, stream.codec_context.height, 0
            for _ in container.decode(stream):
                frames += 1
                if frames > cfg.max_video_frames:
                    raise _Reject("video_too_large", f"{name}: more than {cfg.max_video_frames} frames")
    except _Reject:
        raise
    except Exception as e:  # noqa: BLE001 - any demux/decode failure is a bad video, not a crash
        raise _Reject("video_undecodable", f"{name}: {type(e).__name__}: {e}") from None
    if frames == 0:
        raise _Reject("video_undecodable", f"{name}: no decodable frame")
    return w, h, frames


def _conversations(obj: dict, cfg: ValidationConfig) -> list[dict]:
    conv = obj.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise _Reject("conversation_malformed", "`conversations` missing or empty")
    if len(conv) > cfg.max_turns:
        raise _Reject("conversation_too_long", f"{len(conv)} turns > {cfg.max_turns}")
    out = []
    roles = []  # without system turns
    chars = 0
    for i, turn in enumerate(conv):
        value = turn.get("value") if isinstance(turn, dict) else None
        if not isinstance(value, str):
            raise _Reject("conversation_malformed", f"turn {i} is not {{from, value: str}}")
        role = turn.get("from")
        if role not in ROLES:
            raise _Reject("conversation_malformed", f"turn {i} has role {role!r}, expected one of {sorted(ROLES)}")
        out.append({"from": role, "value": value})
        chars += len(value)
        if role != "system":
            roles.append(role)
    if chars > cfg.max_conversation_chars:
        raise _Reject("conversation_too_long", f"{chars} characters > {cfg.max_conversation_chars}")
    if not roles or roles[0] != "human" or "gpt" not in roles:
        raise _Reject("conversation_malformed", "needs a human turn first and at least one gpt turn")
    for k in range(len(roles) - 1):
        if roles[k] == roles[k + 1]:
            raise _Reject(
                "conversation_malformed",
                f"turns do not alternate: turns {k} and {k + 1} (system turns not counted) are both from {roles[k]!r}",
            )
    return out


def _image_refs(obj: dict) -> list[str] | None:
    """The record's image entries; None when it has no image field (its own members are then
    its images), [] when the field is explicitly empty (text-only)."""
    if "image" not in obj and "images" not in obj:
        return None
    ref = obj.get("image", obj.get("images"))
    if ref is None or ref == "" or ref == []:
        return []
    if isinstance(ref, str):
        return [ref]
    if isinstance(ref, list) and all(isinstance(r, str) and r for r in ref):
        return list(ref)
    raise _Reject("schema_invalid", f"`image` must be a string or a list of strings, got {type(ref).__name__}")


def _missing_detail(what: str, entries: list[str] | None, res: Resolution, own: list[str]) -> str:
    """Why the entries did not all resolve: which one, and what the sample does hold."""
    k = next(i for i, m in enumerate(res.media) if m is None)
    shown = f"{what} {entries[k]!r}" if entries is not None else f"{what} {k}"
    if not own:
        return f"{shown} not found: no member of that name or basename, and the sample has no {what} member"
    n = len(entries) if entries is not None else len(res.media)
    return f"{shown} not found: the sample's {what} members ({', '.join(own)}) are fewer than its {n} {what} entries"


def _reject_outside(entries: list[str] | None, res: Resolution, locator) -> None:
    """An unresolved entry that points out of the input (`../`, a symlink leaving the image
    root) is named as such: it is never read, whatever it points at."""
    for ref, m in zip(entries or [], res.media):
        if m is None and (where := locator.outside(ref)):
            raise _Reject("media_outside_input", f"{ref!r} leads outside the input, to {where}; not read")


def _normalise_placeholders(
    conv: list[dict], n_media: int, placeholder: str = IMAGE_PLACEHOLDER, what: str = "images"
) -> None:
    n_ph = 0
    for t in conv:
        if placeholder in t["value"]:
            n_ph += t["value"].count(placeholder)
    if n_media == n_ph == 0:
        return
    if n_media and n_ph == 0:
        first_human = next(t for t in conv if t["from"] == "human")
        first_human["value"] = f"{placeholder}\n{first_human['value']}"
        return
    if n_ph != n_media:
        raise _Reject("placeholder_mismatch", f"{n_ph} `{placeholder}` placeholders for {n_media} {what}")
    if any(placeholder in t["value"] for t in conv if t["from"] != "human"):
        raise _Reject("placeholder_mismatch", f"`{placeholder}` in a non-human turn")


def validate(raw: RawRecord, cfg: ValidationConfig, keep_image_bytes: bool = False) -> Valid | Invalid:
    """Validate one record. `keep_image_bytes`: hand the checked images' bytes back in
    `Valid.image_bytes` (for curation steps that need pixels), instead of reading them twice."""
    return validate_many([raw], cfg, keep_image_bytes)[0]


def validate_many(
    raws: list[RawRecord], cfg: ValidationConfig, keep_image_bytes: bool = False
) -> list[Valid | Invalid]:
    """`validate` of each record, phase by phase over the batch: every record's JSON,
    conversation and media references, then every record's image checks, then every record's
    placeholders, video and normalised JSON. Each record goes through the same checks in the
    same order as alone, so its result is the same; the batch only changes what runs next to
    what: the decode checks evict the interpreter's code and data from the CPU caches, and a
    record's Python run between two decodes cost about a third more CPU than run in a row
    (measured on the scan: docs/preprocess.md, "Benchmark")."""
    staged = [_parse(raw, cfg) for raw in raws]
    for st in staged:
        if isinstance(st, _Staged):
            _check_images(st, cfg, keep_image_bytes)
    return [_finish(st, cfg) if isinstance(st, _Staged) else st for st in staged]


@dataclass(slots=True)
class _Staged:
    """A record between the phases of `validate_many`."""

    raw: RawRecord
    obj: dict
    by_orjson: bool
    record_id: str
    source: str
    conv: list[dict]
    images: Resolution
    media: list[tuple[MediaRef, str]] = field(default_factory=list)
    sizes: list[list] = field(default_factory=list)
    image_bytes: list[bytes] = field(default_factory=list)
    rejected: Invalid | None = None


def _parse(raw: RawRecord, cfg: ValidationConfig) -> _Staged | Invalid:
    """The record's JSON, schema, conversation and media references (resolved, not read)."""
    record_id, source = raw.rid, ""
    try:
        if raw.error:
            raise _Reject(raw.error, raw.error_detail)
        try:
            obj, by_orjson = fast_json.loads(raw.json_bytes or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Reject("json_malformed", str(e)) from None
        if not isinstance(obj, dict):
            raise _Reject("schema_invalid", f"record is a {type(obj).__name__}, expected an object")
        if "id" in obj and not isinstance(obj["id"], (str, int)):
            raise _Reject("schema_invalid", "`id` must be a string or an integer")
        record_id = str(obj.get("id", raw.rid))
        source = obj.get("source", "") if isinstance(obj.get("source", ""), str) else str(obj.get("source"))
        source = source.replace("\0", "\ufffd")  # (index rows separate fields with NUL)
        conv = _conversations(obj, cfg)
        entries = _image_refs(obj)
        if entries is not None and len(entries) > cfg.max_images_per_record:
            raise _Reject("schema_invalid", f"{len(entries)} images > {cfg.max_images_per_record}")
        images = resolve(entries, raw.own_images, raw.locator)
        if not images.complete:
            _reject_outside(entries, images, raw.locator)
            raise _Reject("image_missing", _missing_detail("image", entries, images, raw.own_images))
        if len(images.media) > cfg.max_images_per_record:
            raise _Reject("schema_invalid", f"{len(images.media)} images > {cfg.max_images_per_record}")
    except _Reject as r:
        return Invalid(r.reason, r.detail, record_id, source)
    return _Staged(raw, obj, by_orjson, record_id, source, conv, images)


def _check_images(st: _Staged, cfg: ValidationConfig, keep_image_bytes: bool) -> None:
    """Read and fully decode-check every image; the first failure rejects the record."""
    try:
        for k, m in enumerate(st.images.media):
            data = st.raw.locator.read(m)
            ext, w, h, mode = check_image(data, m.name, cfg)
            st.media.append((m, image_member_name(k, ext)))
            st.sizes.append([w, h, mode])
            if keep_image_bytes:
                st.image_bytes.append(data)
    except _Reject as r:
        st.rejected = Invalid(r.reason, r.detail, st.record_id, st.source)


def _finish(st: _Staged, cfg: ValidationConfig) -> Valid | Invalid:
    """Placeholders, the video (demuxed and decoded) and the normalised record."""
    if st.rejected is not None:
        return st.rejected
    raw, obj, conv, media, images = st.raw, st.obj, st.conv, st.media, st.images
    try:
        _normalise_placeholders(conv, len(media))
        video_name, video_meta, video_rule = None, None, None
        video_ref = obj.get("video")
        if video_ref not in (None, ""):
            if not isinstance(video_ref, str):
                raise _Reject("schema_invalid", "`video` must be a string")
            video = resolve([video_ref], raw.own_videos, raw.locator)
            if not video.complete:
                _reject_outside([video_ref], video, raw.locator)
                raise _Reject("video_missing", _missing_detail("video", [video_ref], video, raw.own_videos))
            m = video.media[0]
            w, h, frames = check_video(raw.locator.read(m), m.name, cfg)
            ext = m.name.rsplit(".", 1)[-1].lower() if "." in basename(m.name) else "mp4"
            video_name = video_member_name(ext)
            media.append((m, video_name))
            video_meta, video_rule = [w, h, frames], video.rule
        _normalise_placeholders(conv, int(video_name is not None), VIDEO_PLACEHOLDER, "videos")
    except _Reject as r:
        return Invalid(r.reason, r.detail, st.record_id, st.source)
    record_id, source = st.record_id, st.source
    meta = {k: obj[k] for k in META_FIELDS if k in obj}
    provenance = dict(raw.provenance)
    for field_name, key in (("image", "source_image"), ("images", "source_image"), ("video", "source_video")):
        if obj.get(field_name) not in (None, "", []) and key not in provenance:
            provenance[key] = obj[field_name]
    rule = weakest((images.rule, video_rule))
    if rule is not None:
        provenance["media_resolution"] = rule
    if st.sizes:
        meta["image_sizes"] = st.sizes
    if video_meta:
        meta["video_size_frames"] = video_meta
    rec = SampleRecord(
        id=record_id,
        source=source,
        conversations=conv,
        images=[s for _, s in media if s != video_name],
        video=video_name,
        meta=meta,
        provenance=provenance,
    )
    # vars() rather than dataclasses.asdict: asdict deep-copies every nested value (slow, needless).
    record = vars(rec)
    text = fast_json.dumps_sorted(record, st.by_orjson)
    try:
        text.encode()
    except UnicodeEncodeError as e:  # e.g. a lone surrogate written as "\ud800" in the source JSON
        return Invalid("json_malformed", f"text is not valid Unicode: {e.reason} at {e.start}", record_id, source)
    return Valid(text, media, source, record, rule, images.unreferenced, st.image_bytes)
