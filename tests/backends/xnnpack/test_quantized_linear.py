"""TorchAO-quantized Linears on XNNPACK: what the delegate takes gives the eager numbers.

Stock ExecuTorch 1.5.1 lowers a weight-only quantized Linear (IntxWeightOnlyConfig)
to a delegate computing x @ qdata.T + b (the scales dropped); here such a weight is
dequantized by plain ops instead. Dynamically quantized activations
(Int8DynamicActivationIntxWeightConfig) are what XNNPACK supports: delegated whole.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import export

import compiler
from compiler.backends.xnnpack import rules


def _quantized_linear(config):
    from torchao.quantization.quant_api import quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16)).eval()
    quantize_(model, config)
    return model, torch.randn(3, 64)


def _weight_only(dtype, granularity):
    from torchao.quantization.quant_api import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity)


def _dynamic_activation(dtype, granularity):
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=granularity)


def _per_group():
    from torchao.quantization.granularity import PerGroup

    return PerGroup(32)


def _per_channel():
    from torchao.quantization.granularity import PerAxis

    return PerAxis(0)


def _error(artifact, model, x) -> float:
    (out,) = compiler.run(artifact, (x,))
    with torch.no_grad():
        return (out - model(x)).abs().max().item()


def _placed(artifact, op: str) -> list:
    return [p for p in artifact.program.plan.nodes if p.op == op]


WEIGHT_ONLY = [
    pytest.param(torch.int4, _per_group, id="int4-per-group"),
    pytest.param(torch.int4, _per_channel, id="int4-per-channel"),
    pytest.param(torch.int8, _per_group, id="int8-per-group"),
    pytest.param(torch.int8, _per_channel, id="int8-per-channel"),
]


@pytest.mark.parametrize("dtype,granularity", WEIGHT_ONLY)
def test_weight_only_linear_matches_eager(dtype, granularity):
    """Stock gave errors of ~115 (int4) and ~2000 (int8): x @ qdata.T + b."""
    model, x = _quantized_linear(_weight_only(dtype, granularity()))
    artifact = compiler.compile(model, (x,), "xnnpack", reproducer=False)
    assert _error(artifact, model, x) < 1e-5
    # the weight stays int8 in the program; no dequantize_affine reaches the delegate
    assert not _placed(artifact, rules.DEQUANTIZE_AFFINE)
    (gemm,) = _placed(artifact, "aten.addmm.default")
    assert gemm.tag is None and gemm.reason == rules.GEMM_REASON
    casts = _placed(artifact, "dim_order_ops._to_dim_order_copy.default")
    assert casts and all(p.tag is None and "drops the scales" in p.reason for p in casts)


def test_weight_only_int4_linear_folds_and_compiles_for_xnnpack():
    model, x = _quantized_linear(_weight_only(torch.int4, _per_group()))
    artifact = compiler.compile(model, (x,), "xnnpack", reproducer=False)
    assert artifact.report.stage("fold").metrics["folded"] == 3
    assert artifact.program.plan.partitions  # the float dequantize arithmetic is still delegated


def test_dynamic_activation_int4_per_group_is_delegated_whole():
    """XNNPACK's qd8 x qb4w GEMM: one delegate, nothing on the CPU. Its error against
    eager is XNNPACK storing the group scales as bfloat16 (node_visitor.py), and
    nothing else: eager with bf16-rounded scales gives the delegate's numbers."""
    model, x = _quantized_linear(_dynamic_activation(torch.int4, _per_group()))
    artifact = compiler.compile(model, (x,), "xnnpack", reproducer=False)
    assert artifact.program.plan.partitions and not artifact.program.plan.cpu_nodes
    assert 1e-4 < _error(artifact, model, x) < 1e-2
    weight = model[0].weight
    weight.scale.copy_(weight.scale.to(torch.bfloat16).to(torch.float32))
    assert _error(artifact, model, x) < 1e-5


def test_dynamic_activation_int8_per_channel_is_delegated_whole():
    model, x = _quantized_linear(_dynamic_activation(torch.int8, _per_channel()))
    artifact = compiler.compile(model, (x,), "xnnpack", reproducer=False)
    assert artifact.program.plan.partitions and not artifact.program.plan.cpu_nodes
    assert _error(artifact, model, x) < 1e-5


def test_the_rule_keeps_dynamic_gemms_and_refuses_weight_only():
    """The predicate on the Edge graph: both dequantize_affine nodes of a dynamic
    GEMM (activation and weight) are fine, a weight-only one is refused."""
    for config, refused in (
        (_dynamic_activation(torch.int4, _per_group()), 0),
        (_weight_only(torch.int4, _per_group()), 1),
    ):
        model, x = _quantized_linear(config)
        edge = compiler.compile(model, (x,), "xnnpack", stop_after="decompose", reproducer=False).artifact
        nodes = [n for n in edge.program.graph.nodes if n.op == "call_function"]
        dequantized = [n for n in nodes if rules._is_dequantize_affine(n)]
        assert dequantized
        assert sum(rules.scales_dropped(n) is not None for n in dequantized) == refused


def test_stock_xnnpack_still_drops_the_scales():
    """Stock ExecuTorch 1.5.1 on the weight-only int4 Linear: if this starts to pass
    with a small error, stock is fixed and the rewrite in rules.py can go."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    model, x = _quantized_linear(_weight_only(torch.int4, _per_group()))
    pte = to_edge_transform_and_lower(export(model, (x,)), partitioner=[XnnpackPartitioner()]).to_executorch()
    method = Runtime.get().load_program(pte.buffer).load_method("forward")
    (out,) = method.execute([x])
    with torch.no_grad():
        qdata = model[0].weight.qdata.to(torch.float32)
        assert torch.allclose(out, x @ qdata.T + model[0].bias, atol=1e-3)
        assert (out - model(x)).abs().max().item() > 10


def test_a_dequantize_it_cannot_rewrite_is_a_named_error():
    """Blocks that do not divide the weight cannot become plain ops: rather than
    let XNNPACK drop the scales, the partition stage names the node and what to do."""
    from compiler.ir.errors import CompileError

    model, x = _quantized_linear(_weight_only(torch.int4, _per_group()))
    edge = compiler.compile(model, (x,), "xnnpack", stop_after="decompose", reproducer=False).artifact
    (dequantize,) = [n for n in edge.program.graph.nodes if n.op == "call_function" and rules._is_dequantize_affine(n)]
    dequantize.args = (dequantize.args[0], [1, 48], *dequantize.args[2:])
    with pytest.raises(CompileError, match="drops") as err:
        rules.dequantize_with_plain_ops(edge.program)
    assert err.value.nodes == (dequantize.name,)
    assert "Int8DynamicActivationIntxWeightConfig" in err.value.hint
