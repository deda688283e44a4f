"""`build_emu3_loader`: the shared loader factory with the Emu3 task encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mmdata.energon_loaders.emu3.task_encoder import Emu3EncoderConfig, Emu3TaskEncoder
from mmdata.energon_loaders.loader import SavableLoader, build_loader
from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.shard_job.lengths import tokenizer_fingerprint


def build_emu3_loader(
    data: str | Path | Sequence[str | Path],
    tokenizer_path: str | Path,
    *,
    seq_length: int,
    micro_batch_size: int,
    encoder: dict[str, Any] | None = None,
    **loader_kwargs: Any,
) -> SavableLoader:
    """This DP rank's savable loader of `Emu3Batch` over token shards (`mmdata tokenize-images`
    output; infinite: energon repeats epochs). `encoder`: Emu3EncoderConfig fields (tasks,
    p_uncond, uncond_prompt, system_prompt); `loader_kwargs`: `loader.build_loader`'s (dp_rank,
    dp_size, num_workers, seed, packing, buffer sizes...; `sharding="global"` with its options: the
    global order plans with each sample's task and caption drop drawn per epoch from the seed and
    its position, with these task settings and tokenizer)."""
    config = Emu3EncoderConfig(seq_length=seq_length, **(encoder or {}))
    if loader_kwargs.get("sharding") == "global":
        loader_kwargs.setdefault(
            "geometry",
            Emu3PlanGeometry(
                tokenizer_fingerprint(tokenizer_path),
                config.system_prompt,
                config.uncond_prompt,
                dict(config.tasks),
                float(config.p_uncond),
            ),
        )
    return build_loader(
        data, Emu3TaskEncoder(str(tokenizer_path), config), micro_batch_size=micro_batch_size, **loader_kwargs
    )
