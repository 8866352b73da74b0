"""Quantized programs on XNNPACK: each quantize, dequantize and GEMM node says in the placement
report what XNNPACK makes of it, and each GEMM a scheme leaves in float says why."""

from __future__ import annotations

import pytest
import torch

import compiler
from compiler.models.examples import convnet

TAKEN = "the XNNPACK partitioner took it"


class Attention(torch.nn.Module):
    """Linear projections (quantized by every scheme) around two batched matmuls (quantized by none)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return self.out(scores @ self.v(x))


def _placed(model, inputs, scheme, **options):
    result = compiler.compile(model, inputs, "xnnpack", quantize=scheme, calibration=[inputs], cache=False, **options)
    return result.stages["partition"].plan.described()


@pytest.mark.parametrize(
    "scheme, activation, weight",
    [
        ("int8_dynamic", "int8 activations quantized per row at run time", "int8 weights, a scale per output channel"),
        ("int8_static", "int8 activations with a calibrated scale", "int8 weights, a scale per output channel"),
        ("8da4w", "int8 activations quantized per row at run time", "int4 weights, a scale per group of 32"),
    ],
)
def test_every_quantized_node_says_what_xnnpack_makes_of_it(scheme, activation, weight):
    torch.manual_seed(0)
    placed = _placed(Attention().eval(), (torch.randn(1, 8, 64),), scheme)
    quantizing = [n for n in placed if "quant" in n.op or "choose_qparams" in n.op]
    assert quantizing and all(n.backend_id == "XnnpackBackend" and n.reason != TAKEN for n in quantizing)
    linears = [n for n in placed if n.op == "aten.linear.default"]
    assert len(linears) == 4
    for linear in linears:
        assert linear.reason == f"XNNPACK computes it as a quantized GEMM: {activation} x {weight}"
    weights = [n for n in quantizing if n.reason.startswith("the quantized weight of")]
    assert len(weights) == 4 and all(weight in n.reason for n in weights)
    (bmm, bmm_2) = [n for n in placed if n.op == "aten.bmm.default"]
    assert bmm.reason == bmm_2.reason == (
        "a float32 GEMM in a quantized program: nothing quantizes its inputs (the scheme's quantizer "
        "annotates no such op, or its filter skipped the layer)"
    )


def test_a_layer_the_scheme_skips_says_it_stays_in_float():
    """TorchAO's 8da4w quantizes Linear layers only: the convolutions compute in float32."""
    placed = _placed(*convnet(channels=32), "8da4w")  # its head: Linear(64, 10), two groups of 32 a row
    convolutions = [n for n in placed if n.op == "aten.convolution.default"]
    assert len(convolutions) == 2
    assert all(n.reason.startswith("a float32 GEMM in a quantized program") for n in convolutions)
    (linear,) = [n for n in placed if n.op == "aten.linear.default"]
    assert "quantized GEMM" in linear.reason and "int4 weights, a scale per group of 32" in linear.reason


def test_a_float_program_keeps_the_partitioners_reason():
    torch.manual_seed(0)
    placed = _placed(Attention().eval(), (torch.randn(1, 8, 64),), None)
    assert {n.reason for n in placed if n.backend_id} == {TAKEN}


def test_eight_bit_weights_per_group_are_refused_by_name():
    """XNNPACK's group-quantized GEMM takes 4-bit weights only: stock's lowering asserts."""
    from compiler.ir.errors import CompileError, StageFailure
    from compiler.models.examples import mlp

    with pytest.raises(CompileError, match="takes granularity per_channel, not per_group") as raised:
        compiler.compile(*mlp(), "xnnpack", quantize="8da8w", quantize_granularity="per_group", cache=False)
    assert not isinstance(raised.value, StageFailure) and raised.value.stage == "quantize"
    assert "per_channel" in raised.value.hint


def test_eight_bit_weights_per_channel_are_lowered():
    from compiler.models.examples import mlp

    model, inputs = mlp()
    result = compiler.compile(model, inputs, "xnnpack", quantize="8da8w", quantize_granularity="per_channel", cache=False)
    assert compiler.compare_with_eager(result, model, inputs).passed


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(512, 64)

    def forward(self, ids):
        return self.table(ids) * 2


@pytest.mark.parametrize("embedding, group", [("4w", 32), ("8w", 0)])
def test_a_quantized_table_dequantizes_the_rows_looked_up_not_the_table(embedding, group):
    # The whole table was dequantized at every call (GPT-2 small's 8da4w program ran 2.3x slower than float).
    import compiler
    from compiler.running.runtime import LoadedProgram

    torch.manual_seed(0)
    model, ids = _Lookup().eval(), (torch.randint(0, 512, (2, 7)),)
    result = compiler.compile(model, ids, "xnnpack", quantize_embedding=embedding,
                              quantize_embedding_group_size=group, cache=False)
    program = result.stages["partition"].program
    table_elements = model.table.weight.numel()
    floats = [n.name for n in program.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()
              and n.meta["val"].numel() >= table_elements]
    assert not floats, floats
    check = compiler.compare_with_eager(result, model, ids)
    assert check.passed, check.describe()
    quantized = result.stages["quantize"].module
    torch.testing.assert_close(LoadedProgram(result)(ids)[0], quantized(*ids), atol=0, rtol=0)
