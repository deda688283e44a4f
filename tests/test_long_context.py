"""Long contexts, unit level: the context-parallel token layout (against megatron's own split),
the grouped varlen attention (against per-sample attention), the blocked LM loss (against full
logits, in the function and in the model, tied and untied) and what the cost model makes of
them. Multi-process checks (vocab-parallel TP=2 loss, CPU context-parallel attention) run in
one torchrun launch: tests/workers/long_context_worker.py. Training-level CP runs are in
test_train_runtime.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmtrain.models.context_parallel import cp_layout, padding_multiple

WORKERS = Path(__file__).parent / "workers"


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# ----------------------------------------------------------------------------- CP layout


class _Group:
    """What megatron's get_batch_on_this_cp_rank asks of a CP group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.unit
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_layout_is_megatrons_split_for_whole_rows(megatron_cpu, cp):
    """Rows of one sequence each: our layout = megatron.core.utils.get_batch_on_this_cp_rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    b, s = 3, 8 * cp
    stream = torch.arange(b * s)
    for rank in range(cp):
        ref = get_batch_on_this_cp_rank({"tokens": stream.view(b, s).clone()}, cp_group=_Group(cp, rank))["tokens"]
        layout = cp_layout(_cu([s] * b), cp, rank, padding_multiple(cp, 1))
        assert torch.equal(layout.split(stream), ref.reshape(-1))


@pytest.mark.unit
def test_cp_layout_pads_every_sequence_and_covers_the_stream_once():
    lens = [5, 13, 1, 0, 30, 7]  # packed samples and a padding run, one empty segment
    cu, total = _cu(lens), sum(lens)
    cp, mult = 2, padding_multiple(2, 2)  # 2*cp*tp = 8
    seen = torch.zeros(total, dtype=torch.long)
    stream = torch.arange(total) + 100
    for rank in range(cp):
        lay = cp_layout(cu, cp, rank, mult)
        assert lay.cu_seqlens.tolist() == [0, 8, 24, 32, 64, 72] and lay.max_seqlen == 32
        assert lay.local_tokens == 72 // cp and lay.local_tokens % 2 == 0  # SP can split it over tp=2
        idx = lay.index[lay.index < total]
        seen[idx] += 1
        local = lay.split(stream, fill=-1)
        assert torch.equal(local[lay.index < total], stream[idx]) and (local[lay.index == total] == -1).all()
        # chunks r and 2cp-1-r of every padded sequence, padding slots at sequence ends only
        first = lay.index[:4].tolist()  # sequence 0 (5 tokens, padded to 8): chunks of 2
        assert first == ([0, 1, total, total] if rank == 0 else [2, 3, 4, total])
        # scatter puts local values back where they came from, zeros elsewhere (differentiable)
        vals = torch.randn(lay.local_tokens, requires_grad=True)
        back = lay.scatter(vals)
        assert back.shape == (total,) and torch.equal(back[idx], vals[lay.index < total])
        assert torch.equal(lay.held(), torch.isin(torch.arange(total), idx))
        back.sum().backward()
        assert torch.equal(vals.grad, (lay.index < total).float())
    assert (seen == 1).all()


# ----------------------------------------------------------------------------- varlen attention


def _per_sample(q, k, v, lens, causal):
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],
                k[sl].transpose(0, 1)[None],
                v[sl].transpose(0, 1)[None],
                is_causal=causal,
                enable_gqa=True,
            )[0].transpose(0, 1)
        )
        start += n
    return torch.cat(outs)


@pytest.mark.unit
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [[37, 5, 120, 64, 64, 1, 300, 9], [64] * 4], ids=["mixed", "equal"])
def test_grouped_varlen_attention_equals_per_sample(causal, lens):
    from mmtrain.models.attention import VarlenPlan, grouped_varlen_sdpa

    torch.manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, 2, 16, dtype=torch.float64, requires_grad=True)
    plan = VarlenPlan.build(_cu(lens).tolist())
    assert len(plan.groups) < len(lens) and sum(n for n, _ in plan.groups) == len(lens)
    grad = torch.randn(t, 4, 16, dtype=torch.float64)
    ref = _per_sample(q, k, v, lens, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = grouped_varlen_sdpa(q, k, v, plan, causal=causal, scale=16**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_core_attention_thd_uses_the_cached_plan(megatron_cpu):
    """Every layer of a micro-batch reuses one plan (built from cu_seqlens once)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmtrain.models.attention import SDPACoreAttention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    attn = SDPACoreAttention(cfg, 1, AttnMaskType.causal)
    lens = [10, 3, 19]
    params = cp_layout(_cu(lens), 1, 0, 1).packed_seq_params()
    q, k, v = torch.randn(32, 4, 8), torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (32, 32)
    plan = params._plans["varlen"]
    attn(q, k, v, None, packed_seq_params=params)
    assert params._plans["varlen"] is plan
    torch.testing.assert_close(out, _per_sample(q, k, v, lens, True).reshape(32, -1))


# ----------------------------------------------------------------------------- the LM loss


@pytest.mark.unit
def test_blocked_cross_entropy_equals_full_logits():
    from mmtrain.models.lm_loss import linear_cross_entropy

    torch.manual_seed(0)
    n, h, vocab, true_vocab = 333, 24, 1000, 977  # padded table: rows >= 977 never enter the softmax
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(vocab, h) * 0.3).requires_grad_()
    labels = torch.randint(0, true_vocab, (n,))
    labels[::4] = -100
    scale = torch.rand(n)
    logits = (hidden @ weight.t()).masked_fill(torch.arange(vocab) >= true_vocab, float("-inf"))
    ref = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    ref_grads = torch.autograd.grad((ref * scale).sum(), (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, true_vocab=true_vocab, block_mb=1)  # several blocks
    grads = torch.autograd.grad((out * scale).sum(), (hidden, weight))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert (out[::4] == 0).all() and (grads[0][::4] == 0).all()


@pytest.mark.unit
@pytest.mark.parametrize("tied", [True, False])
def test_decoder_lean_loss_equals_megatrons_output_layer(megatron_cpu, tied):
    """The same DecoderLM weights with `chunked` and `plain` (megatron's output layer + its
    vocab-parallel cross entropy over full logits): per-token losses and every gradient agree."""
    from benchmarks.tiny_models import tiny_llm
    from mmtrain.models.language_model import build_language_model
    from mmtrain.models.lm_config import padded_vocab_size
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config

    llm = tiny_llm(2, 32, 64, 4, 2, vocab=250, positions=256, tie_word_embeddings=tied)
    cfg = language_transformer_config(llm, "float32", ParallelOptions())
    results = []
    for impl in ("plain", "chunked"):
        torch.manual_seed(0)
        model = build_language_model(llm, cfg, vocab_size=padded_vocab_size(250, 64), loss_impl=impl, loss_block_mb=1)
        lens = [40, 17, 71]
        ids = torch.randint(0, 250, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
        labels = torch.randint(0, 250, (1, sum(lens)), generator=torch.Generator().manual_seed(2))
        labels[0, ::3] = -100
        params = cp_layout(_cu(lens), 1, 0, 1).packed_seq_params()
        loss = model(input_ids=ids, position_ids=None, attention_mask=None, labels=labels, packed_seq_params=params)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref, ref_grads), (out, grads) = results
    assert out.shape == (1, sum(lens)) and (out[0, ::3] == 0).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and ("output_layer.weight" in grads) != tied
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max() <= 1e-5 * ref_grads[name].abs().max(), name


# ----------------------------------------------------------------------------- the cost model


@pytest.mark.unit
def test_cost_model_knows_the_lean_loss_and_context_parallelism():
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.planning.cost_model import GB, Layout, estimate_memory

    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "aquila-vl-2b.yaml",
        [
            "stage=2a",
            "parallel.cp=1",
            "parallel.sequence_parallel=false",
            "train.micro_batch_size=2",
            "train.global_batch_size=512",
        ],
    )
    shapes, base = LLAVA_OV.model_shapes(recipe.model), Layout.from_recipe(recipe)
    assert base.seq_length == 12288 and base.micro_batch_size == 2
    plain = estimate_memory(shapes, recipe.freeze, base.with_(lm_loss="plain"))
    lean = estimate_memory(shapes, recipe.freeze, base.with_(lm_loss="chunked"))
    assert plain.logits > 20 * GB  # [24,576 x 151,936] logits + fp32 softmax
    assert lean.logits <= 2 * GB
    cp2 = estimate_memory(shapes, recipe.freeze, base.with_(lm_loss="chunked", cp=2, dp=base.dp // 2))
    assert cp2.activations == pytest.approx(lean.activations / 2)
    assert cp2.weights == lean.weights


# ----------------------------------------------------------------------------- multi-process


def test_vocab_parallel_loss_and_cpu_context_parallel_attention(tmp_path):
    """2 processes (gloo): the blocked loss at TP=2 (vocab-parallel, padded table) equals the
    full-logits loss; the K/V all-gather CP attention at CP=2 equals whole-sequence attention,
    outputs and gradients, for packed sequences of uneven lengths."""
    from tests.fixtures_convert import torchrun

    result = tmp_path / "result.json"
    torchrun(WORKERS / "long_context_worker.py", str(result))
    res = json.loads(result.read_text())
    for key in ("tp_loss", "tp_grad_hidden", "tp_grad_weight", "cp_out", "cp_grad_q", "cp_grad_k", "cp_grad_v"):
        assert res[key] <= 1e-5, (key, res[key])
