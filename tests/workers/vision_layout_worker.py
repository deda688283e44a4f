"""torchrun worker (4 ranks, gloo) for tests/test_vision_layout.py; rank 0 writes RESULT_JSON.

For each layout (TP=4; TP=2 x CP=2; TP=2 x DP=2) the tiny LLaVA-OV is built twice from the same HF
weights, with the vision tower inherited (TP-sharded like the LLM) and with its own layout
(`encoder_tp=1`: a whole tower per rank, the tiles split over TP x CP), and one training step of
two micro-batches (megatron DDP, its schedule and `finalize_model_grads`, as the trainer runs
them) is compared: the loss, every gradient (the separate layout's whole tower gradients cut to
the inherited layout's TP shards), and the vision tower's forward FLOPs on each rank (torch's
FlopCounterMode). The second micro-batch has two tiles, fewer than the four shares: ranks with an
empty share. At TP=4, weights saved by one layout are loaded by the other (dist-checkpointing),
and the separate layout's checkpoint read back unsharded is the HF model's tensors.

argv: CKPT_DIR RESULT_JSON
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYOUTS = [(4, 1), (2, 2), (2, 1)]  # (tp, cp); dp = 4 / (tp * cp)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def batches(cfg, dp_rank: int):
    """Two micro-batches: four samples (three anyres images, a video), one row each; then one
    sample with a two-tile image. DP ranks get different ones."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.llava_ov import anyres
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from tests.llava_tiny import IMAGE_SIZE, IMAGE_TOKEN, PATCH, VIDEO_TOKEN, hf_image_inputs, images

    def labelled(b):
        ids = b.input_ids
        b.labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
        b.labels[(b.labels == IMAGE_TOKEN) | (b.labels == VIDEO_TOKEN) | (b.labels == 0)] = IGNORE_INDEX
        return b

    rows, pv, sizes = hf_image_inputs(images(dp_rank), seed=dp_rank)
    g = torch.Generator().manual_seed(10 + dp_rank)
    frames = torch.randn(1, 3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    video = torch.cat(
        [
            torch.randint(1, 990, (5,), generator=g),
            torch.full((anyres.num_video_tokens(3, IMAGE_SIZE, PATCH),), VIDEO_TOKEN),
            torch.randint(1, 990, (9,), generator=g),
        ]
    )
    all_rows = rows + [video]
    s = max(len(r) for r in all_rows)
    ids, mask = torch.zeros(len(all_rows), s, dtype=torch.long), torch.zeros(len(all_rows), s, dtype=torch.long)
    for i, r in enumerate(all_rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    first = labelled(hf_inputs_to_batch(cfg, ids, pv, sizes, mask, pixel_values_videos=frames))
    small_rows, small_pv, small_sizes = hf_image_inputs(images(dp_rank)[2:], seed=5 + dp_rank)
    second = labelled(hf_inputs_to_batch(cfg, small_rows[0][None], small_pv, small_sizes))
    assert int(second.tiles_per_media.sum()) == 2
    return [first, second]


def train_step(model, micro_batches, seq_length):
    """One step as the trainer runs it: megatron DDP, the schedule, finalize_model_grads.
    Returns (loss over the global batch, {name: main_grad}, vision forward FLOPs)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.runtime.loss import lm_loss_sums
    from mmtrain.runtime.optimizer import ddp_config_kwargs

    model.model_type = ModelType.encoder_or_decoder
    config = get_model_config(model)
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(**ddp_config_kwargs(SimpleNamespace(distributed_optimizer=False))), model
    )
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[ddp],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=False,
    )
    sums = lm_loss_sums(reports, torch.device("cpu"))
    torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(sums[0] / sums[1]), grads, vision_forward_flops(model, micro_batches)


def vision_forward_flops(model, micro_batches) -> int:
    """The vision tower's forward FLOPs on this rank over the micro-batches (torch's FlopCounterMode;
    the tower frozen meanwhile: megatron's viewless outputs under no_grad confuse its module
    tracker, and a trainable tower on a rank without tiles adds a one-patch zero term)."""
    from torch.utils.flop_counter import FlopCounterMode

    tower = model.vision_model
    trainable = [p for p in tower.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with FlopCounterMode(display=False) as counter:
            for b in micro_batches:
                model(b)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return sum(counter.get_flop_counts().get(f"{type(model).__name__}.vision_model", {}).values())


def compare_layout(tp: int, cp: int, hf_state, res: dict) -> None:
    from megatron.core import parallel_state as ps

    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.state_dict_adapter import LlavaOVStateDictAdapter
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.model_io import load_canonical, shard_for
    from mmtrain.runtime.distributed import ensure_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ensure_model_parallel(tp, 1, cp=cp)
    cfg, sd = hf_state
    adapter = LlavaOVStateDictAdapter(cfg)
    micro = batches(cfg, ps.get_data_parallel_rank())
    seq = max(b.input_ids.numel() for b in micro)
    out = {}
    for name, encoder_tp in (("inherited", None), ("separate", 1)):
        model = LlavaOVModel(cfg, options=ParallelOptions(encoder_tp=encoder_tp))
        load_canonical(model, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
        out[name] = (model, *train_step(model, micro, seq))
    (inh, loss_i, grads_i, flops_i), (sep, loss_s, grads_s, flops_s) = out["inherited"], out["separate"]
    assert set(grads_i) == set(grads_s)
    tp_rank, params_i = ps.get_tensor_model_parallel_rank(), dict(inh.named_parameters())
    worst, worst_name, vision_seen = 0.0, "", 0
    for n, g in grads_s.items():
        if n.startswith("vision_model."):  # the whole tower's gradient vs the inherited shard
            vision_seen += 1
            g = shard_for(g, params_i[n], n, False, tp_rank, tp)
        err = rel(g, grads_i[n])
        if err > worst:
            worst, worst_name = err, n
    row = {
        "loss_inherited": loss_i,
        "loss_separate": loss_s,
        "max_grad_rel_err": worst,
        "worst_param": worst_name,
        "vision_params": vision_seen,
        "vision_grad_nonzero": bool(
            all(grads_s[n].abs().sum() > 0 for n in grads_s if n.startswith("vision_model.decoder"))
        ),
        "tiles": [int(b.tiles_per_media.sum()) for b in micro],
    }
    # per-rank forward FLOPs of the tower, and the whole tower's on all the tiles (one rank)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        for b in micro:
            sep.vision_model(b.pixel_values)
    whole = sum(counter.get_flop_counts()["Global"].values())
    flops = torch.tensor([flops_i, flops_s, whole], dtype=torch.float64)
    every = [torch.zeros_like(flops) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, flops)
    row["flops_inherited"] = [float(f[0]) for f in every]
    row["flops_separate"] = [float(f[1]) for f in every]
    row["flops_whole_tower"] = float(every[0][2])
    res[f"tp{tp}-cp{cp}"] = row
    if (tp, cp) == (4, 1):
        res["checkpoint"] = checkpoint_round_trips(cfg, adapter, sd)


def checkpoint_round_trips(cfg, adapter, sd) -> dict:
    """Weights saved by one layout load into the other (a random init overwritten); the separate
    layout's saved tensors, read back whole, are the HF model's."""
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.checkpoint.weights import load_model_weights, save_model_weights

    ckpt = Path(sys.argv[1])
    out = {}
    for src_name, src_tp, dst_tp in (("separate", 1, None), ("inherited", None, 1)):
        src = LlavaOVModel(cfg, options=ParallelOptions(encoder_tp=src_tp))
        load_canonical(src, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
        save_model_weights([src], ckpt / src_name, iteration=0, model_config=cfg)
        torch.manual_seed(99)
        dst = LlavaOVModel(cfg, options=ParallelOptions(encoder_tp=dst_tp))
        load_model_weights([dst], ckpt / src_name)
        out[f"{src_name}_to_other_max_abs_err"] = max(
            float((p.detach() - expected_shard(adapter, sd, p, n, dst)).abs().max()) for n, p in dst.named_parameters()
        )
    if torch.distributed.get_rank() == 0:
        from benchmarks.common import read_dist_ckpt

        saved = read_dist_ckpt(ckpt / "separate" / "iter_0000000" / "model", prefix="vision_model.")
        out["saved_vision_tensors"] = len(saved)
        errs = []
        for k, t in saved.items():  # megatron stacks the layers along a leading axis
            head, layers, tail = k.partition(".layers.")
            pairs = [(t[i], f"{head}.layers.{i}.{tail}") for i in range(t.shape[0])] if layers else [(t, k)]
            errs += [float((x - adapter.mcore_tensor(name, sd.__getitem__)).abs().max()) for x, name in pairs]
        out["saved_vs_hf_max_abs_err"] = max(errs)
    return out


def expected_shard(adapter, sd, param, name, model):
    """The HF model's tensor for `name`, cut as `param` is sharded."""
    from megatron.core import parallel_state as ps

    from mmtrain.models.model_io import _is_gated_fc1, canonical_name, shard_for

    cname = canonical_name(model, name)
    full = adapter.mcore_tensor(cname, sd.__getitem__)
    return shard_for(
        full,
        param,
        cname,
        _is_gated_fc1(model, name),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )


def main() -> None:
    torch.set_num_threads(1)
    from mmtrain.llava_ov.state_dict_adapter import llava_config_from_hf, normalize_llava_hf_key
    from tests.llava_tiny import hf_llava

    hf = hf_llava(seed=0, text={"num_key_value_heads": 4}, vision={"num_attention_heads": 4})  # TP=4 splits both
    cfg = llava_config_from_hf(hf.config.to_dict())
    sd = {normalize_llava_hf_key(k): v for k, v in hf.state_dict().items()}
    res: dict = {}
    for tp, cp in LAYOUTS:
        compare_layout(tp, cp, (cfg, sd), res)
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
