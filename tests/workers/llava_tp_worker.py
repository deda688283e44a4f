"""torchrun worker (2 ranks, gloo): LLaVA-OV at TP=2 vs the HF model.

argv: HF_DIR TP1_CKPT_DIR OUT_CKPT_DIR RESULT_JSON
- weights streamed from HF straight into TP=2 shards -> logits / loss vs HF
- a TP=1 dist checkpoint loaded into the TP=2 model (resharding) -> logits vs HF
- the TP=2 model saved to OUT_CKPT_DIR (the test reloads it at TP=1)
"""

import sys

import torch


def main() -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.conversion import build_stage, llava_source
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.llava_ov.load import load_hf_into_model
    from tests.llava_tiny import IMAGE_TOKEN, hf_image_inputs, images
    from tests.workers.tp_parity import check_tp2_loads, gaps_to_hf, start_tp2

    hf, cfg = start_tp2(LlavaOnevisionForConditionalGeneration, llava_source, sys.argv[1])
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[0][None]
    labels = ids.clone()
    labels[ids == IMAGE_TOKEN] = IGNORE_INDEX
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pv[:1], image_sizes=sizes[:1], labels=labels)

    def check(model):
        return gaps_to_hf(model, hf_inputs_to_batch(cfg, ids, pv[:1], sizes[:1]), labels, forward_step, ref)

    qkv_rows = (
        "local_qkv_rows",
        lambda model: model.language_model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
    )
    check_tp2_loads(sys.argv[1:5], cfg, build_stage, load_hf_into_model, check, qkv_rows)


if __name__ == "__main__":
    main()
