"""The LLaVA-OneVision TaskEncoder: conversation samples -> packed `LlavaOVBatch`es.

Stages (energon hooks, all `@stateless` so energon can replay them on restore):
1. `preencode_sample`: read image headers / probe the video (sizes -> token counts, no pixel
   decode), render + tokenize the chat with media expanded, shift labels, apply the
   over-length policy. Cheap and small, so the packing buffer holds encoded bytes, not tiles.
2. `select_samples_to_pack`: largest-first knapsack over the buffer into `seq_length` bins, then
   samples exchanged between the bins to even their vision tiles (`row_mix.pack_buffer`).
3. `postencode_sample`: decode pixels (anyres / base-only / video frames) for chosen samples.
4. `pack_selected_samples` + `batch` -> `collate_rows`: rows, position ids, cu_seqlens,
   flattened media.

Packing, counted skips and the batch hook are the common `task_encoding.PackingTaskEncoder`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from megatron.energon import Sample, edataclass, stateless
from PIL import Image

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, MEDIA_BASE_ONLY, MEDIA_VIDEO, LlavaOVBatch
from mmdata.energon_loaders.llava_ov.chat_template import (
    DEFAULT_SYSTEM_PROMPT,
    ChatTokenizer,
    ConversationError,
    with_video_placeholder,
)
from mmdata.energon_loaders.sample import ConversationSample
from mmdata.energon_loaders.task_encoding import PackingTaskEncoder, packed_batch_fields
from mmdata.media_layout import jpeg
from mmdata.media_layout.media import DEFAULT_MAX_FRAMES
from mmdata.energon_loaders.video import decode_frames, probe_video
from mmdata.private_api import new_shared_storage


def _decode_image(data: bytes) -> Image.Image:
    """The decoded image: libjpeg-turbo directly for the JPEGs where its pixels are Pillow's bit
    for bit (`jpeg.decode_rgb_exact`; its raw decode is about 1.5x Pillow's, but the copy into a
    PIL image that anyres needs leaves 1.0-1.1x: docs/loaders.md), Pillow's full load for the rest."""
    exact = jpeg.decode_rgb_exact(data)
    if exact is not None:
        return exact
    im = Image.open(io.BytesIO(data))
    try:
        im.load()
    except BaseException:
        im.close()
        raise
    return im


@dataclass
class LlavaOVEncoderConfig:
    seq_length: int
    max_tiles: int = anyres.DEFAULT_MAX_TILES
    image_size: int = anyres.DEFAULT_IMAGE_SIZE
    patch_size: int = anyres.DEFAULT_PATCH_SIZE
    grid_max: int = anyres.DEFAULT_GRID_MAX
    max_video_frames: int = DEFAULT_MAX_FRAMES
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    image_mean: tuple[float, float, float] = anyres.SIGLIP_MEAN
    image_std: tuple[float, float, float] = anyres.SIGLIP_STD


@dataclass
class MediaRef:
    """A media item before pixel decoding: enough to count tokens and decode later."""

    kind: int  # MEDIA_*
    data: bytes
    size: tuple[int, int]  # (height, width)
    num_tokens: int
    grid: tuple[int, int]
    frame_indices: list[int] | None = None

    @property
    def num_tiles(self) -> int:
        """Tiles the vision tower will encode: base + anyres grid, one (an image of several), or
        one per sampled frame (the `PreparedMedia.num_tiles` it becomes)."""
        if self.kind == MEDIA_VIDEO:
            return len(self.frame_indices or [])
        return 1 + self.grid[0] * self.grid[1] if self.kind == MEDIA_ANYRES else 1


@dataclass
class EncodedMedia:
    """Decoded media, still uint8 canvases: cut into float tiles only when the batch is built."""

    kind: int
    prepared: anyres.PreparedMedia

    @property
    def num_tokens(self) -> int:
        return self.prepared.num_tokens


@edataclass
class LlavaOVSample(Sample):
    """One tokenized sample; `media` holds MediaRef before postencode, EncodedMedia after."""

    id: str
    input_ids: np.ndarray
    labels: np.ndarray  # shifted
    media: list
    truncated: bool = False


class LlavaOVTaskEncoder(PackingTaskEncoder):
    """ConversationSample -> LlavaOVSample (pre/post-encode) -> packed LlavaOVBatch."""

    sample_type = ConversationSample

    config: LlavaOVEncoderConfig

    # -- helpers -------------------------------------------------------------------------------

    def build_text(self, tokenizer) -> ChatTokenizer:
        return ChatTokenizer(tokenizer, system_prompt=self.config.system_prompt)

    @property
    def chat(self) -> ChatTokenizer:
        return self.text

    def _image_ref(self, data: bytes, kind: int, where: str, sample_id: str) -> MediaRef:
        c = self.config
        try:
            with Image.open(io.BytesIO(data)) as im:
                width, height = im.size
        except Exception as exc:  # noqa: BLE001 - any decoder error is a bad sample
            raise self._skip("image_decode", sample_id, f"{where}: {exc}") from exc
        if width < 1 or height < 1:
            raise self._skip("image_decode", sample_id, f"{where}: empty size")
        grid, n = anyres.image_layout(
            height,
            width,
            kind == MEDIA_ANYRES,
            image_size=c.image_size,
            patch_size=c.patch_size,
            max_tiles=c.max_tiles,
            grid_max=c.grid_max,
        )
        return MediaRef(kind, data, (height, width), n, grid)

    def vision_tiles(self, sample: LlavaOVSample) -> int:
        return sum(m.num_tiles for m in sample.media)

    # -- energon hooks ---------------------------------------------------------------------------

    @stateless
    def preencode_sample(self, sample: ConversationSample) -> LlavaOVSample:
        self._require_sample_type(sample)
        c = self.config
        sid = str(sample.id)
        images = list(sample.images or [])
        kind = MEDIA_ANYRES if len(images) == 1 else MEDIA_BASE_ONLY
        media = [
            self._image_ref(
                data, kind, f"image {i} ({sample.image_names[i] if i < len(sample.image_names) else '?'})", sid
            )
            for i, data in enumerate(images)
        ]
        conversations = list(sample.conversations)
        video_counts: list[int] = []
        if sample.video is not None:
            try:
                probe = probe_video(bytes(sample.video), c.max_video_frames)
            except Exception as exc:  # noqa: BLE001
                raise self._skip("video_decode", sid, str(exc)) from exc
            n = anyres.num_video_tokens(len(probe.frame_indices), c.image_size, c.patch_size)
            media.append(MediaRef(MEDIA_VIDEO, bytes(sample.video), (0, 0), n, (0, 0), probe.frame_indices))
            video_counts.append(n)
            conversations = with_video_placeholder(conversations)
        try:
            tokens = self.chat.tokenize(
                conversations, [m.num_tokens for m in media if m.kind != MEDIA_VIDEO], video_counts
            )
        except ConversationError as exc:
            raise self._skip(exc.reason, sid, str(exc)) from exc
        result = self._fit_length(tokens, sid)
        # media order in the stream = placeholder order; tokenize() consumed images then videos
        # in their own orders, so re-order refs to follow the token stream.
        image_refs = iter([m for m in media if m.kind != MEDIA_VIDEO])
        video_refs = iter([m for m in media if m.kind == MEDIA_VIDEO])
        ordered = [next(image_refs) if k == "image" else next(video_refs) for k, _, _ in result.tokens.media_spans]
        return self._encoded(LlavaOVSample, sample, sid, result, media=ordered)

    @stateless
    def postencode_sample(self, sample: LlavaOVSample) -> LlavaOVSample:
        c = self.config
        geometry = dict(image_size=c.image_size, patch_size=c.patch_size)
        encoded: list[EncodedMedia] = []
        for i, ref in enumerate(sample.media):
            try:
                if ref.kind == MEDIA_VIDEO:
                    out = anyres.prepare_frames(decode_frames(ref.data, ref.frame_indices or []), **geometry)
                else:
                    with _decode_image(ref.data) as im:
                        if ref.kind == MEDIA_ANYRES:
                            out = anyres.prepare_image(im, c.max_tiles, grid_max=c.grid_max, **geometry)
                        else:
                            out = anyres.prepare_base_only(im, mean=c.image_mean, **geometry)
            except Exception as exc:  # noqa: BLE001 - bit rot, truncated files, codec errors
                reason = "video_decode" if ref.kind == MEDIA_VIDEO else "image_decode"
                raise self._skip(reason, sample.id, f"media {i}: {exc}") from exc
            if out.num_tokens != ref.num_tokens:
                raise self._skip("media_size_changed", sample.id, f"media {i}: {out.num_tokens} != {ref.num_tokens}")
            encoded.append(EncodedMedia(ref.kind, out))
        return LlavaOVSample.derive_from(
            sample,
            id=sample.id,
            input_ids=sample.input_ids,
            labels=sample.labels,
            media=encoded,
            truncated=sample.truncated,
        )

    def collate(self, rows: list[list[LlavaOVSample]], stats: dict[str, int]) -> LlavaOVBatch:
        return collate_rows(rows, self.config, self.chat.pad_token_id, stats)


def _batch_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor for the batch's pixels (the model normalises them on the device); in a
    DataLoader worker it is allocated in shared memory directly (as torch's default_collate
    does), so handing it to the trainer process costs no extra copy of the tiles."""
    numel = 1
    for d in shape:
        numel *= d
    if torch.utils.data.get_worker_info() is None or numel == 0:
        return torch.empty(shape, dtype=torch.uint8)
    storage = new_shared_storage(numel)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)


def collate_rows(
    rows: list[list[LlavaOVSample]],
    config: LlavaOVEncoderConfig,
    pad_token_id: int,
    stats: dict[str, int] | None = None,
) -> LlavaOVBatch:
    """Rows of post-encoded samples -> the model batch (conventions: batch.py, ../batch.py)."""
    media: list[EncodedMedia] = [m for row in rows for s in row for m in s.media]
    prepared = [m.prepared for m in media]
    shape = (sum(p.num_tiles for p in prepared), 3, config.image_size, config.image_size)
    pixel_values = anyres.tiles_to_uint8(prepared, config.image_size, out=_batch_tensor(shape))

    def _long(values: list, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).reshape(shape)

    n = len(media)
    return LlavaOVBatch(
        **packed_batch_fields(rows, config.seq_length, pad_token_id, stats),
        pixel_values=pixel_values,
        pixel_mean=tuple(config.image_mean),
        pixel_std=tuple(config.image_std),
        tiles_per_media=_long([p.num_tiles for p in prepared], (n,)),
        media_kind=_long([m.kind for m in media], (n,)),
        image_sizes=_long([list(p.image_size) for p in prepared], (n, 2)),
        grid_shapes=_long([list(p.grid_shape) for p in prepared], (n, 2)),
        num_media_tokens=_long([m.num_tokens for m in media], (n,)),
        media_per_row=[sum(len(s.media) for s in row) for row in rows],
    )
