"""torchrun worker (2 ranks, gloo): LLaVA-OV at TP=2 vs the HF model.

argv: HF_DIR TP1_CKPT_DIR OUT_CKPT_DIR RESULT_JSON
- weights streamed from HF straight into TP=2 shards -> logits / loss vs HF
- a TP=1 dist checkpoint loaded into the TP=2 model (resharding) -> logits vs HF
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
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.conversion import build_stage, llava_source
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.llava_ov.load import load_hf_into_model
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.runtime.checkpoint.weights import load_model_weights, save_model_weights
    from mmtrain.runtime.distributed import ensure_model_parallel
    from tests.llava_tiny import IMAGE_TOKEN, hf_image_inputs, images

    ensure_model_parallel(2, 1)
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(hf_dir).eval()
    cfg, _ = llava_source(hf_dir)
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[0][None]
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = IGNORE_INDEX
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv[:1], image_sizes=sizes[:1], labels=labels)

    def check(model):
        batch = hf_inputs_to_batch(cfg, ids, pv[:1], sizes[:1])
        with torch.no_grad():
            logits = model(batch, return_logits=True)
            batch.labels = torch.cat([labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
            out, loss_fn = forward_step(iter([batch]), model)
            loss_sum, n, _ = loss_fn(out)
        return (logits - ref.logits).abs().max().item(), abs(loss_sum.item() / int(n) - ref.loss.item())

    res = {}
    model = build_stage(cfg).eval()
    load_hf_into_model([model], hf_dir)
    res["from_hf"] = check(model)
    res["local_qkv_rows"] = int(model.language_model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0])
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
