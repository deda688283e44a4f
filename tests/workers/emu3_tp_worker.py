"""torchrun worker (2 ranks, gloo): Emu3 at TP=2 vs the HF model.

argv: HF_DIR TP1_CKPT_DIR OUT_CKPT_DIR RESULT_JSON
- weights streamed from HF straight into TP=2 shards -> logits / loss vs HF
- a TP=1 dist checkpoint loaded into the TP=2 model (resharding), with and without sequence
  parallelism -> logits / loss vs HF
- the TP=2 model saved to OUT_CKPT_DIR (the test reloads it at TP=1)
"""

import json
import sys

import torch


def main() -> None:
    torch.set_num_threads(1)
    hf_dir, tp1_ckpt, out_ckpt, result = sys.argv[1:5]
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from megatron.core import parallel_state
    from transformers import Emu3ForConditionalGeneration

    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.emu3.conversion import build_stage, emu3_source
    from mmtrain.emu3.load import hf_inputs_to_batch, load_hf_into_model
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.runtime.checkpoint.weights import load_model_weights, save_model_weights
    from mmtrain.runtime.distributed import ensure_model_parallel
    from mmtrain.runtime.loss import packed_forward_step

    ensure_model_parallel(2, 1)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    hf = Emu3ForConditionalGeneration.from_pretrained(hf_dir).eval()
    cfg, _ = emu3_source(hf_dir)
    ids = torch.randint(0, cfg.llm.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)

    def check(model):
        batch = hf_inputs_to_batch(ids)
        with torch.no_grad():
            logits = model(batch, return_logits=True)
            batch.labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
            out, loss_fn = packed_forward_step(iter([batch]), model)
            loss_sum, n, _ = loss_fn(out)
        return (logits - ref.logits).abs().max().item(), abs(loss_sum.item() / int(n) - ref.loss.item())

    res = {}
    model = build_stage(cfg).eval()
    load_hf_into_model([model], hf_dir)
    res["from_hf"] = check(model)
    res["local_vocab_rows"] = int(model.language_model.output_layer.weight.shape[0])
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


if __name__ == "__main__":
    main()
