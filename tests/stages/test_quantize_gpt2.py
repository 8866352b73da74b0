"""GPT-2 quantized. transformers' Conv1D (its layers, a Linear with its weight stored transposed)
is quantized as the Linear it is: before, 8da4w quantized only its lm_head (the .pte 0.94x the
float one). And PT2E's int8 schemes keep its integer positions integers."""

import pytest
import torch

import compiler

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    from compiler.models.model_suite import gpt2

    model, inputs, *_ = gpt2(layers=2, embd=64, seq=8, vocab=128)
    return model, inputs


def test_conv1d_layers_are_quantized_as_linears_and_the_program_agrees(gpt2):
    from transformers.pytorch_utils import Conv1D

    model, inputs = gpt2
    conv1d = sum(isinstance(m, Conv1D) for m in model.modules())
    assert conv1d == 8  # c_attn, c_proj, c_fc, mlp.c_proj per block
    quantized = compiler.compile(model, inputs, "xnnpack", quantize="8da4w", cache=False)
    float_program = compiler.compile(model, inputs, "xnnpack", cache=False)
    [row] = [r for r in quantized.report.stages if r.stage == "quantize"]
    assert row.metrics["conv1d_as_linear"] == conv1d
    eager = quantized.stages["quantize"].module
    assert not any(isinstance(m, Conv1D) for m in eager.modules())
    assert any(isinstance(m, Conv1D) for m in model.modules())  # the user's model is not changed
    assert len(quantized.pte) < 0.5 * len(float_program.pte)
    check = compiler.compare_with_eager(quantized, model, inputs)
    assert check.passed, check.describe()


def test_conv1d_swapped_for_linear_computes_the_same(gpt2):
    from compiler.stages.quantize import _conv1d_as_linear, _module_tree_copy

    model, inputs = gpt2
    copy = _module_tree_copy(model)
    assert _conv1d_as_linear(copy) == 8
    with torch.no_grad():
        torch.testing.assert_close(copy(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_the_stock_quantizer_makes_gpt2s_integer_positions_float_and_ours_does_not(gpt2):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from compiler.backends.xnnpack.quantizer import pt2e_quantizer

    model, inputs = gpt2
    graph = torch.export.export(model, inputs).module()
    stock = prepare_pt2e(graph, XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_dynamic=True)))
    with pytest.raises(RuntimeError, match="'indices' to have one of the following scalar types: Long, Int"):
        stock(*inputs)
    ours = prepare_pt2e(torch.export.export(model, inputs).module(), pt2e_quantizer(per_channel=True, dynamic=True))
    assert ours(*inputs).shape == model(*inputs).shape


@pytest.mark.slow  # two PT2E compiles and their checks
@pytest.mark.parametrize("scheme", ["int8_dynamic", "int8_static"])
def test_gpt2_compiles_and_passes_with_pt2e_int8_schemes(gpt2, scheme):
    model, inputs = gpt2
    extra = {"calibration": [inputs]} if scheme == "int8_static" else {}
    quantized = compiler.compile(model, inputs, "xnnpack", quantize=scheme, cache=False, **extra)
    check = compiler.compare_with_eager(quantized, model, inputs)
    assert check.passed, (scheme, check.describe())
