"""torchrun worker (2 ranks, gloo) for tests/test_long_context.py; writes max relative errors.

1. TP=2: the blocked vocab-parallel loss (`lm_loss.linear_cross_entropy`, each rank holding half
   of a padded output table, hidden states through megatron's TP copy) against the full-logits
   cross entropy on one process's worth of data: losses, grad of the hidden states, grad of this
   rank's weight rows.
2. CP=2: `KVAllGatherCoreAttention` on each rank's share of a packed stream (megatron's 2*cp
   layout) against causal attention over each whole sequence: outputs and q/k/v gradients,
   gathered back to stream order.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def vocab_parallel(res: dict) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from mmtrain.models.lm_loss import linear_cross_entropy

    torch.manual_seed(0)  # same data on both ranks
    n, h, vocab, true_vocab = 200, 16, 512, 500
    hidden = torch.randn(n, h, dtype=torch.float64)
    weight = torch.randn(vocab, h, dtype=torch.float64) * 0.3
    labels = torch.randint(0, true_vocab, (n,))
    labels[::5] = -100
    scale = torch.rand(n, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (ref_h @ ref_w.t()).masked_fill(torch.arange(vocab) >= true_vocab, float("-inf"))
    ref = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    (ref * scale).sum().backward()

    rank, part = parallel_state.get_tensor_model_parallel_rank(), vocab // 2
    h_in = hidden.clone().requires_grad_()
    w_local = weight[rank * part : (rank + 1) * part].clone().requires_grad_()
    group = parallel_state.get_tensor_model_parallel_group()
    out = linear_cross_entropy(
        tensor_parallel.copy_to_tensor_model_parallel_region(h_in, group=group),
        w_local,
        labels,
        vocab_start=rank * part,
        true_vocab=true_vocab,
        block_mb=1,
        group=group,
    )
    (out * scale).sum().backward()
    res["tp_loss"] = rel(out, ref)
    res["tp_grad_hidden"] = rel(h_in.grad, ref_h.grad)
    res["tp_grad_weight"] = rel(w_local.grad, ref_w.grad[rank * part : (rank + 1) * part])


def context_parallel(res: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.reference_ops import per_sample_attention
    from mmtrain.models.context_parallel import current_layout
    from mmtrain.models.cp_attention import KVAllGatherCoreAttention

    torch.manual_seed(1)
    lens = [45, 8, 130, 3, 60]
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(total, 4, 8, dtype=torch.float64)
    k = torch.randn(total, 2, 8, dtype=torch.float64)
    v = torch.randn(total, 2, 8, dtype=torch.float64)
    grad = torch.randn(total, 32, dtype=torch.float64)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = per_sample_attention(*ref_in, lens)
    ref.backward(grad)

    layout = current_layout(cu)
    assert layout.cp == 2 and layout.rank == parallel_state.get_context_parallel_rank()
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        context_parallel_size=2,
        params_dtype=torch.float64,
        attention_dropout=0.0,
    )
    attn = KVAllGatherCoreAttention(cfg, 1, AttnMaskType.causal)
    local = [layout.split(x).clone().requires_grad_() for x in (q, k, v)]
    out = attn(*local, None, packed_seq_params=layout.packed_seq_params())
    out.backward(layout.split(grad))
    # back to stream order: each rank holds its positions, zeros elsewhere; sum over the CP group
    full = [layout.scatter(t) for t in (out.detach(), *(x.grad for x in local))]
    for t in full:
        torch.distributed.all_reduce(t, group=parallel_state.get_context_parallel_group())
    res["cp_out"] = rel(full[0], ref.detach())
    res["cp_grad_q"], res["cp_grad_k"], res["cp_grad_v"] = (
        rel(a.reshape(b.shape), b.grad) for a, b in zip(full[1:], ref_in)
    )


def main() -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from mmtrain.runtime.distributed import ensure_model_parallel

    res: dict = {}
    ensure_model_parallel(2, 1)
    vocab_parallel(res)
    parallel_state.destroy_model_parallel()
    ensure_model_parallel(1, 1, cp=2)
    context_parallel(res)
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(res))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
