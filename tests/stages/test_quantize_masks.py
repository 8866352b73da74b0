"""PT2E schemes quantize float32 and half-precision values only. XNNPACK's and Core ML's
quantizers annotate every `cat`, so pi0's padding masks (bool, concatenated) and its float64
timestep embedding got observers: `"linspace_cpu" not implemented for 'Bool'` at calibration."""

import pytest
import torch

import compiler


class MaskedConcat(torch.nn.Module):
    """pi0's shape: bool padding masks concatenated, a float64 sinusoidal embedding concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(18, 8)

    def forward(self, x, y, pad):
        hx, hy = self.a(x), self.b(y)
        mask = torch.cat([pad, torch.ones(pad.shape, dtype=torch.bool)], dim=1)
        time = torch.arange(8, dtype=torch.float64).reshape(1, 8, 1) * 0.1
        sinusoid = torch.cat([torch.sin(time), torch.cos(time)], dim=-1).to(hx.dtype)
        h = torch.cat([torch.cat([hx, hy], dim=1), sinusoid], dim=-1)
        return self.out(h) * mask.unsqueeze(-1).to(h.dtype)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    pad = torch.tensor([[True, True, False, True]])
    return MaskedConcat().eval(), (torch.randn(1, 4, 16), torch.randn(1, 4, 16), pad)


def test_the_stock_quantizer_observes_the_bool_mask(model):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    module, inputs = model
    graph = torch.export.export(module, inputs).module()
    prepared = prepare_pt2e(graph, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
    with pytest.raises(NotImplementedError, match="not implemented for 'Bool'"):
        prepared(*inputs)


@pytest.mark.parametrize("backend", ["xnnpack", pytest.param("portable", marks=pytest.mark.slow),
                                     pytest.param("coreml", marks=pytest.mark.slow)])
def test_int8_static_leaves_masks_and_float64_alone(model, backend):
    from compiler.backends import pt2e

    module, inputs = model
    result = compiler.compile(module, inputs, backend, quantize="int8_static", calibration=[inputs], cache=False)
    eager = result.stages["quantize"].module
    observed = [n for n in eager.graph.nodes if "quantize_per" in str(n.target)]
    assert observed, "the Linears are quantized"
    for node in observed:
        value = node.args[0].meta.get("val")
        assert not isinstance(value, torch.Tensor) or value.dtype in pt2e.QUANTIZABLE, node.format_node()
    check = compiler.compare_with_eager(result, module, inputs)
    assert check.passed, check.describe()
