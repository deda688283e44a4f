"""`LlavaOVModel`: SigLIP + the mlp2x_gelu projector + the LLaVA-OV feature layout + the shared Qwen2 decoder.
Design notes: docs/architecture.md, "LlavaOVModel"."""

from __future__ import annotations

from typing import Optional

import torch

from mmdata.energon_loaders.batch import host_to_device
from mmdata.energon_loaders.llava_ov.anyres import normalise_pixels
from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.layout import pack_media_features
from mmtrain.llava_ov.projector import build_projector, projector_transformer_config
from mmtrain.llava_ov.vision import SiglipVisionModel, vision_transformer_config
from mmtrain.models.context_parallel import CPLayout, current_layout
from mmtrain.models.encoder_parallel import (
    EncoderShare,
    broadcast_over_tp,
    gather_shares,
    mark_replicated_over_tp,
    prepare_groups,
    replicated_sharded_state_dict,
    scale_gradient,
)
from mmtrain.models.language_model import embed_tokens, packed_decoder_forward
from mmtrain.models.megatron_config import ParallelOptions, base_config_kwargs
from mmtrain.models.stage_model import DecoderStageModel
from mmtrain.models.device import compute_device


class LlavaOVModel(DecoderStageModel):
    """One pipeline stage of LLaVA-OV.

    `forward(batch)` returns, on the last stage, the per-token loss `[B, S]` (0 where the label is
    IGNORE_INDEX, and at positions another CP rank holds) or, with `return_logits=True`, logits
    `[B, S, vocab]` gathered over TP and cut to the true vocabulary; on other stages the hidden
    states for the next stage (`models.language_model.packed_decoder_forward`).
    """

    def __init__(self, cfg: LlavaOVModelConfig, **kwargs) -> None:
        if cfg.image_token_id is None or cfg.video_token_id is None:
            raise ValueError(
                "model.image_token_id / video_token_id are null: they are read from the tokenizer "
                "before a run starts (or pin them in the recipe)"
            )
        super().__init__(cfg, **kwargs)  # (pre_process, post_process, options, vp_stage)

    def build_encoders(self, options: ParallelOptions) -> None:
        self.vision_model: Optional[SiglipVisionModel] = None
        self.vision_projection = None
        #: the tower's own layout (None: the language model's)
        self.encoder_share: Optional[EncoderShare] = None
        prepare_groups(options.encoder_tp)  # every rank, first stage or not (a collective over the world)
        if not self.pre_process:
            return
        cfg, device = self.cfg, compute_device()
        # the vision tower and projector run whole on the first stage: no SP, no PP split
        base = base_config_kwargs(cfg.params_dtype, options, sequence_parallel=False) | {
            "pipeline_model_parallel_size": 1
        }
        tower_base, tower_groups = base, None
        if options.encoder_tp is not None:
            self.encoder_share = EncoderShare.create(options.encoder_tp, device)
            tower_base = base | {"tensor_model_parallel_size": options.encoder_tp}
            tower_groups = self.encoder_share.tower_process_groups()
        self.vision_model = SiglipVisionModel(
            cfg.vision, vision_transformer_config(cfg.vision, tower_base), pg_collection=tower_groups
        )
        if self.encoder_share is not None and self.encoder_share.replicated_over_tp:
            mark_replicated_over_tp(self.vision_model)
            if options.perform_initialization:
                broadcast_over_tp(self.vision_model, device)
        self.vision_projection = build_projector(cfg, projector_transformer_config(cfg, base))
        self.image_newline = torch.nn.Parameter(
            torch.randn(cfg.llm.hidden_size, dtype=self.config.params_dtype) / cfg.llm.hidden_size**0.5
        )

    # ------------------------------------------------------------------ pieces
    def media_embeddings(
        self, batch: LlavaOVBatch, media: Optional[torch.Tensor] = None, tower_out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Projected + laid-out features of the batch's media (all, or the media indices
        `media`, in order), [positions, hidden]. `tower_out`: the tower's output for all the
        batch's tiles when it was computed already (the separate layout), else it runs here."""
        assert self.vision_model is not None and self.vision_projection is not None
        # the metadata are host tensors (LlavaOVBatch.HOST_FIELDS): these reads never sync
        tiles, kind, sizes = batch.tiles_per_media, batch.media_kind, batch.image_sizes
        grids, counts = batch.grid_shapes, batch.num_media_tokens
        source = batch.pixel_values if tower_out is None else tower_out
        if media is not None:
            first_tile = torch.cumsum(tiles, 0) - tiles
            tile_idx = torch.cat(
                [torch.arange(int(first_tile[m]), int(first_tile[m] + tiles[m])) for m in media.tolist()]
            )
            source = source.index_select(0, host_to_device(tile_idx, source.device))
            tiles, kind, sizes = tiles[media], kind[media], sizes[media]
            grids = grids[media] if grids is not None else None
            counts = counts[media] if counts is not None else None
        if tower_out is None:
            source = self.vision_model(self._normalised(source, batch))
        feats = self.vision_projection(source)
        return pack_media_features(feats, tiles, kind, sizes, grids, self.image_newline, self.cfg, counts)

    @staticmethod
    def _normalised(pixels: torch.Tensor, batch: LlavaOVBatch) -> torch.Tensor:
        if pixels.dtype == torch.uint8:  # the loader's tiles: normalised here, on the device
            return normalise_pixels(pixels, batch.pixel_mean, batch.pixel_std)
        return pixels

    def _encode_shares(self, batch: LlavaOVBatch) -> torch.Tensor:
        """The separate layout: this rank encodes its share of the batch's tiles and receives
        everyone's; [tiles, patches, vision hidden]. Collective over the TP x CP group."""
        share = self.encoder_share
        assert share is not None and self.vision_model is not None
        pixels = batch.pixel_values
        first, count, sizes = share.my_tiles(pixels.shape[0])
        if count:
            local = self.vision_model(self._normalised(pixels[first : first + count], batch))
        else:
            v, w = self.cfg.vision, self.vision_model.conv1.weight
            local = torch.zeros((0, v.num_patches, v.hidden_size), dtype=w.dtype, device=w.device)
            if torch.is_grad_enabled() and any(p.requires_grad for p in self.vision_model.parameters()):
                # no tile for this rank: an empty share that still reaches every tower parameter
                local = local + self.vision_model.one_patch_output().sum() * 0.0
        return gather_shares(scale_gradient(local, share.grad_scale), share, sizes)

    def _decoder_input(self, batch: LlavaOVBatch, layout: CPLayout) -> torch.Tensor:
        """Token embeddings of this rank's share of the stream with the media features spliced
        in, [t_local, 1, h]. Under context parallelism the vision tower runs only on the media
        that have positions on this rank (see `_local_media`)."""
        emb = embed_tokens(self.language_model, batch, layout)
        ids = batch.host_input_ids().reshape(-1)  # placeholders located on the host: no sync
        is_media = (ids == self.cfg.image_token_id) | (ids == self.cfg.video_token_id)
        n_pos = int(is_media.sum())
        encoded = False
        if batch.pixel_values is not None and batch.pixel_values.numel() > 0:
            rows, media, feature_rows = self._local_media(batch, layout, is_media, emb.device)
            # the separate layout encodes on every rank, media held or not (a collective)
            tower_out = self._encode_shares(batch) if self.encoder_share is not None else None
            if media is None or media.numel():
                encoded = True
                feats = self.media_embeddings(batch, media, tower_out).to(emb.dtype)
                if media is None and feats.shape[0] != n_pos:
                    raise ValueError(
                        f"input_ids hold {n_pos} image/video placeholder tokens but the media give {feats.shape[0]} "
                        f"features"
                    )
                emb = emb.clone()
                emb[rows, 0] = feats if feature_rows is None else feats[feature_rows]
            elif tower_out is not None and tower_out.requires_grad:
                # no media position here: the gathered output still takes part in the backward,
                # whose all-reduce over the CP group every rank joins
                emb = emb + tower_out.sum().to(emb.dtype) * 0.0
        elif n_pos:
            raise ValueError(f"input_ids hold {n_pos} image/video placeholder tokens but the batch has no pixel_values")
        if not encoded and self._encoders_need_grad():
            emb = emb + self._zero_encoder_term().to(emb.dtype)
        return emb

    def _encoders_need_grad(self) -> bool:
        """Whether a backward will follow that must reach the vision tower, projector or newline."""
        encoders = [self.vision_model, self.vision_projection]
        return torch.is_grad_enabled() and (
            self.image_newline.requires_grad or any(p.requires_grad for m in encoders for p in m.parameters())
        )

    def _zero_encoder_term(self) -> torch.Tensor:
        """A scalar 0 that depends on every vision tower, projector and newline parameter.

        Why: a text-only micro-batch, or a CP rank holding no media position, would leave those
        parameters without a gradient, and megatron DDP's overlapped grad reduce asserts on a
        parameter that got none. Added to the embeddings it changes no value (x + 0
        is x) and gives them zero gradients; the tower sees one patch (`one_patch_output`), so
        the extra compute is negligible."""
        assert self.vision_model is not None and self.vision_projection is not None
        feats = self.vision_projection(self.vision_model.one_patch_output())
        return (feats.sum() + self.image_newline.sum()) * 0.0

    def _local_media(
        self, batch: LlavaOVBatch, layout: CPLayout, is_media: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(local rows that take a media feature, the media to encode (None: all), the row of
        each of those features in the encoded media's output (None: in order)).

        Each image/video occupies consecutive positions, and a rank holds 2 chunks of every
        sequence, so most media fall on one or two ranks: encoding only those avoids running
        the whole vision tower cp times. A media cut by a chunk boundary is encoded by each
        rank that holds part of it (its features are computed whole: the anyres layout mixes
        tiles), and each rank back-propagates only through the positions it holds, so the
        gradients summed over the CP group are exact.

        `is_media` and the metadata are host tensors; the index tensors go to `device` once."""
        if layout.index is None:
            return host_to_device(is_media.nonzero(as_tuple=True)[0], device), None, None
        counts = batch.num_media_tokens.to(torch.long).cpu()
        if int(counts.sum()) != int(is_media.sum()):
            raise ValueError(
                f"input_ids hold {int(is_media.sum())} image/video placeholder tokens but the "
                f"batch counts {int(counts.sum())} media tokens"
            )
        index = layout.index
        held = torch.cat([is_media.cpu(), torch.zeros(1, dtype=torch.bool)])[index]  # local rows on media
        rows = held.nonzero(as_tuple=True)[0]
        feature = (torch.cumsum(is_media.cpu().to(torch.long), 0) - 1)[index[rows]]  # global feature index
        media_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)[feature]
        media = torch.unique(media_of)
        first = torch.cumsum(counts, 0) - counts  # each media's first feature, all media
        first_encoded = torch.cumsum(counts[media], 0) - counts[media]  # ... among the encoded ones
        slot = torch.searchsorted(media, media_of)
        feature_rows = feature - first[media_of] + first_encoded[slot]
        return host_to_device(rows, device), media, host_to_device(feature_rows, device)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron's, with a tower replicated over TP saved as megatron saves TP-replicated
        tensors (models/encoder_parallel.py): whole, by TP rank 0."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.encoder_share is not None and self.encoder_share.replicated_over_tp:
            sharded = replicated_sharded_state_dict(sharded, f"{prefix}vision_model.")
        return sharded

    # ------------------------------------------------------------------ forward
    def forward(self, batch: LlavaOVBatch, return_logits: bool = False) -> torch.Tensor:
        layout = current_layout(batch.host_cu_seqlens())  # this CP rank's share (the identity without CP)
        decoder_input = self._decoder_input(batch, layout) if self.pre_process else None
        return packed_decoder_forward(self.language_model, batch, layout, decoder_input, return_logits)
