"""torchrun worker (2 ranks, gloo): Emu3 at TP=2 vs the HF model.

argv: HF_DIR TP1_CKPT_DIR OUT_CKPT_DIR RESULT_JSON
- weights streamed from HF straight into TP=2 shards -> logits / loss vs HF
- a TP=1 dist checkpoint loaded into the TP=2 model (resharding), with and without sequence
  parallelism -> logits / loss vs HF
- the TP=2 model saved to OUT_CKPT_DIR (the test reloads it at TP=1)
"""

import sys

import torch


def main() -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from transformers import Emu3ForConditionalGeneration

    from mmtrain.emu3.conversion import build_stage, emu3_source
    from mmtrain.emu3.load import hf_inputs_to_batch, load_hf_into_model
    from mmtrain.runtime.loss import packed_forward_step
    from tests.workers.tp_parity import check_tp2_loads, gaps_to_hf, start_tp2

    hf, cfg = start_tp2(Emu3ForConditionalGeneration, emu3_source, sys.argv[1])
    ids = torch.randint(0, cfg.llm.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)

    def check(model):
        return gaps_to_hf(model, hf_inputs_to_batch(ids), ids, packed_forward_step, ref)

    vocab_rows = ("local_vocab_rows", lambda model: model.language_model.output_layer.weight.shape[0])
    check_tp2_loads(sys.argv[1:5], cfg, build_stage, load_hf_into_model, check, vocab_rows)


if __name__ == "__main__":
    main()
