"""Issue 29 C1/C2: the TE decoder switch (decision logic, adapter name mapping) on CPU."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.models.megatron_config import TransformerImplUnavailable, decoder_fusions
from mmtrain.models.state_dict_adapter import Qwen2StateDictAdapter, to_local_name, to_te_name
from benchmarks.tiny_models import tiny_llm

pytestmark = pytest.mark.unit

LLM = tiny_llm(2, 8, 16, 2, 1, vocab=32, positions=64, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True)


def test_local_keeps_fusions_off():
    f = decoder_fusions(on_cuda=True, te_available=True, transformer_impl="local")
    assert not (f.use_te_spec or f.apply_rope_fusion or f.bias_activation_fusion or f.gradient_accumulation_fusion)


def test_te_on_cuda_with_te_turns_decoder_fusions_on():
    f = decoder_fusions(on_cuda=True, te_available=True, transformer_impl="transformer_engine", apex_wgrad=True)
    assert f.use_te_spec and f.apply_rope_fusion and f.bias_activation_fusion and f.gradient_accumulation_fusion
    f = decoder_fusions(on_cuda=True, te_available=True, transformer_impl="transformer_engine", apex_wgrad=False)
    assert f.use_te_spec and f.apply_rope_fusion and f.bias_activation_fusion and not f.gradient_accumulation_fusion


def _te_switch_config(**fusions) -> TransformerConfig:
    """The decoder config the TE switch builds, less `apply_rope_fusion` (its check needs TE's
    kernel at config time; the review's reproduction drops it the same way)."""
    kw = {**fusions, "apply_rope_fusion": False}
    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        **kw,
    )


def test_the_te_switch_builds_megatrons_output_layer_without_apex(megatron_cpu):
    """N1: GPTModel's output layer is always megatron's local ColumnParallelLinear, which raises
    at build when `gradient_accumulation_fusion` is on and apex's `fused_weight_gradient_mlp_cuda`
    does not import (mcore 0.16.1 tensor_parallel/layers.py:924-933). The TE switch's config must
    build it on an install without apex (this one: pip cannot install apex)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = _te_switch_config(**decoder_fusions(True, True, "transformer_engine").config_kwargs())
    layer = ColumnParallelLinear(64, 1152, config=config, init_method=config.init_method, bias=False)
    assert layer.weight.shape == (1152, 64) and not config.gradient_accumulation_fusion


def test_the_te_switch_keeps_the_wgrad_fusion_where_apex_imports(tmp_path, monkeypatch):
    """Where apex's extension imports (a real module on sys.path here), the decision keeps the
    fusion on: megatron then builds its output layer with it, and TE's linears fuse as well."""
    import sys

    from mmtrain.models.te_support import APEX_WGRAD_MODULE, apex_wgrad_fusion_available

    (tmp_path / f"{APEX_WGRAD_MODULE}.py").write_text("def wgrad_gemm_accum_fp32(*a):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, APEX_WGRAD_MODULE, raising=False)
    try:
        assert apex_wgrad_fusion_available()
        assert decoder_fusions(True, True, "transformer_engine").gradient_accumulation_fusion
    finally:
        sys.modules.pop(APEX_WGRAD_MODULE, None)


def test_te_refused_on_cpu_and_without_te():
    with pytest.raises(TransformerImplUnavailable, match="CUDA"):
        decoder_fusions(on_cuda=False, te_available=True, transformer_impl="transformer_engine")
    with pytest.raises(TransformerImplUnavailable, match="import transformer_engine failed"):
        decoder_fusions(True, False, "transformer_engine", "import transformer_engine failed: X")


def _hf(adapter):
    g = torch.Generator().manual_seed(0)
    # build a tiny HF state dict through the local adapter's megatron->HF direction
    local = Qwen2StateDictAdapter(LLM)
    mc = {}
    for m, _hf_names, op in local._pairs:
        shape = (
            (16, 8)
            if op == "qkv" and m.endswith("weight")
            else (16,)
            if op == "qkv"
            else ((32, 16) if op == "cat" else (32, 8) if "embeddings" in m else (8,) if "norm" in m else (8, 16))
        )
        mc[m] = torch.randn(shape, generator=g)
    return mc, dict(local.iter_hf(mc.__getitem__))


def test_hf_te_hf_round_trip_is_identity_and_names_map_both_ways():
    mc_local, hf = _hf(None)
    te = Qwen2StateDictAdapter(LLM, transformer_impl="transformer_engine")
    names = te.mcore_names()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    mc_te = {n: te.mcore_tensor(n, hf.__getitem__) for n in names}
    back = dict(te.iter_hf(mc_te.__getitem__))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # a local-layout checkpoint's names map to the TE names and back
    assert sorted(to_te_name(n) for n in mc_local) == sorted(names)
    assert all(to_local_name(to_te_name(n)) == n for n in mc_local)
    assert (
        to_te_name("vision_model.decoder.layers.0.input_layernorm.weight", "language_model.")
        == "vision_model.decoder.layers.0.input_layernorm.weight"
    )


def test_the_te_spec_without_te_says_why(megatron_cpu):
    from mmtrain.models.layer_specs import decoder_layer_spec

    with pytest.raises(RuntimeError, match="import transformer_engine failed"):
        decoder_layer_spec("transformer_engine")
    assert decoder_layer_spec("local").module.__name__ == "TransformerLayer"


def test_a_checkpoint_loads_only_into_the_spec_that_wrote_it(tmp_path):
    """TE's spec names the pre-norms `linear_qkv.layer_norm_weight`, the local one
    `input_layernorm.weight`: a resume across the switch is refused up front, naming the way out."""
    import json

    from mmtrain.runtime.checkpoint.manager import check_layer_spec
    from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError

    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "transformer_impl": "transformer_engine"}))
    check_layer_spec(tmp_path, "transformer_engine")
    with pytest.raises(CheckpointMismatchError, match="mcore-to-hf"):
        check_layer_spec(tmp_path, "local")
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2}))  # older checkpoints: local
    check_layer_spec(tmp_path, "local")


@pytest.mark.parametrize("name", ["swiglu", "swiglu_back"])
def test_the_fused_swiglu_compiles_at_most_twice_over_thd_lengths(name):
    """N10: the TE switch's `bias_activation_fusion` runs megatron's SwiGLU under `jit_fuser`, i.e.
    torch.compile (mcore 0.16.1 jit.py, fusions/fused_bias_swiglu.py). Rows are padded to
    seq_length, so without CP every micro-batch has the same THD length (one compile); under CP a
    rank's share changes with the sequences' padding. Over changing lengths dynamo compiles the
    first length, then one shape-generic graph, and never again: kept on, no recompile storm.
    (A counting backend: dynamo decides recompiles before any backend runs.)"""
    import inspect

    from megatron.core.fusions import fused_bias_swiglu

    fn = inspect.unwrap(getattr(fused_bias_swiglu, name))
    assert fn is not getattr(fused_bias_swiglu, name), "megatron's jit_fuser is no longer torch.compile"
    graphs = []
    torch.compiler.reset()
    compiled = torch.compile(fn, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
    try:
        for tokens in (1000, 1357, 811, 2048, 97, 4096, 2, 3000):
            y = torch.randn(tokens, 1, 64)
            compiled(y) if name == "swiglu" else compiled(torch.randn(tokens, 1, 32), y)
    finally:
        torch.compiler.reset()
    assert len(graphs) == 2
