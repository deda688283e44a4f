"""What the TP=2 parity workers (emu3_tp_worker, llava_tp_worker; torchrun, 2 ranks, gloo)
share: the model-parallel setup, the logits / loss gaps to the HF model, and the loads they
check: weights streamed from HF straight into TP=2 shards, a TP=1 dist checkpoint loaded into
the TP=2 model (resharding) without and with sequence parallelism, the TP=2 model saved for the
test to reload at TP=1. Imported after the worker put the repository on sys.path."""

from __future__ import annotations

import json
from typing import Callable

import torch
from megatron.core import parallel_state

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.runtime.checkpoint.weights import load_model_weights, save_model_weights
from mmtrain.runtime.distributed import ensure_model_parallel


def start_tp2(hf_class, source: Callable, hf_dir: str):
    """TP=2 set up, then the HF model of `hf_dir` (eval mode) and our config of it (`source`)."""
    torch.set_num_threads(1)
    ensure_model_parallel(2, 1)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    return hf_class.from_pretrained(hf_dir).eval(), source(hf_dir)[0]


def gaps_to_hf(model, batch, labels: torch.Tensor, forward_step, ref) -> tuple[float, float]:
    """(max |logits - HF logits|, |mean loss - HF loss|) of `model` on `batch`, whose HF labels
    (unshifted) are `labels`; `forward_step`: the family's megatron forward step."""
    with torch.no_grad():
        logits = model(batch, return_logits=True)
        batch.labels = torch.cat([labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        out, loss_fn = forward_step(iter([batch]), model)
        loss_sum, n, _ = loss_fn(out)
    return (logits - ref.logits).abs().max().item(), abs(loss_sum.item() / int(n) - ref.loss.item())


def check_tp2_loads(argv: list[str], cfg, build_stage, load_hf_into_model, check: Callable, shard_rows) -> None:
    """argv: HF_DIR TP1_CKPT_DIR OUT_CKPT_DIR RESULT_JSON. `check(model)`: its gaps to HF;
    `shard_rows`: (name, rows of one of the TP=2 model's sharded weights), recorded as the proof
    of sharding. Rank 0 writes the results to RESULT_JSON."""
    hf_dir, tp1_ckpt, out_ckpt, result = argv[:4]
    res = {}
    model = build_stage(cfg).eval()
    load_hf_into_model([model], hf_dir)
    res["from_hf"] = check(model)
    name, rows_of = shard_rows
    res[name] = int(rows_of(model))
    save_model_weights([model], out_ckpt, iteration=0, model_config=cfg)
    model2 = build_stage(cfg).eval()
    load_model_weights([model2], tp1_ckpt)
    res["from_tp1_ckpt"] = check(model2)
    model3 = build_stage(cfg, ParallelOptions(sequence_parallel=True)).eval()
    assert model3.config.sequence_parallel
    load_model_weights([model3], tp1_ckpt)
    res["sequence_parallel"] = check(model3)
    if torch.distributed.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(res, f)
    torch.distributed.barrier()
