"""The MIL reference interpreter runs Core ML payloads here and agrees with eager PyTorch.

Each built-in example, fully delegated to Core ML, is compiled with float32 and with
float16 (the default) compute precision; the one payload's MIL program runs on the
example inputs (its only MIL inputs are the model's: weights and buffers are inside the
payload). float32 agrees with eager within 1e-5; float16 within 1e-2 of the output's
largest magnitude (measured: at most 9e-4, the transformer: float16's unit roundoff
4.9e-4 over two blocks of layer norms, attention and GELU), and differs from float32
by more than 1e-4 of it, so the program's float16 is what runs.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import coremltools as ct
from executorch.backends.apple.coreml.compiler import CoreMLBackend

from compiler.backends.coreml import mil_kernels
from compiler.backends.coreml.interpreter import (
    MilInterpreter,
    UnsupportedMilOp,
    covered_ops,
    load_programs,
)
from compiler.examples import EXAMPLES
from coreml_helpers import compile_coreml, models, stock_pte

FP32 = [CoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)]
PRECISIONS = {"fp32": {"compile_specs": FP32}, "fp16": {}}


@pytest.fixture(scope="module")
def compiled():
    """(example, precision) -> (artifact, eager output, interpreter output)."""
    results = {}
    for name, factory in EXAMPLES.items():
        model, inputs = factory()
        with torch.no_grad():
            expected = model(*inputs).numpy()
        for precision, options in PRECISIONS.items():
            artifact = compile_coreml(model, inputs, **options)
            results[name, precision] = (artifact, expected, _run_one(artifact.pte, inputs))
    return results


def _run_one(pte, inputs):
    [program] = load_programs(pte)
    interpreter = MilInterpreter(program)
    # Constants and buffers are inside the payload: the MIL inputs are the model's inputs.
    assert len(interpreter.input_names) == len(inputs)
    outputs = interpreter.run(dict(zip(interpreter.input_names, (t.numpy() for t in inputs))))
    [output] = outputs.values()
    return output


def _error(actual, expected):
    return float(np.abs(actual.astype(np.float64) - expected).max())


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_match_eager(compiled, name):
    fp32_artifact, expected, fp32 = compiled[name, "fp32"]
    fp16_artifact, _, fp16 = compiled[name, "fp16"]
    for artifact in (fp32_artifact, fp16_artifact):
        assert not artifact.program.plan.cpu_nodes  # the whole model is one Core ML payload
    scale = float(np.abs(expected).max())
    assert fp32.shape == fp16.shape == expected.shape
    assert _error(fp32, expected) < 1e-5
    assert _error(fp16, expected) < 1e-2 * scale
    assert _error(fp16, fp32) > 1e-4 * scale  # float16 compute precision is honoured


def test_coverage_holds_every_example_op(compiled):
    used = {t for artifact, _, _ in compiled.values() for m in models(artifact) for t in m.op_types()}
    assert used <= set(covered_ops())
    assert covered_ops() == sorted(covered_ops())


class TanhGelu(torch.nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def test_interpreter_catches_stock_tanh_gelu():
    """Ours converts tanh GELU as TANH_APPROXIMATION; stock as exact GELU, silently."""
    model, inputs = TanhGelu().eval(), (torch.linspace(-4, 4, 257).reshape(1, 257),)
    expected = model(*inputs).numpy()
    ours = _run_one(compile_coreml(model, inputs, compile_specs=FP32).pte, inputs)
    stock = _run_one(stock_pte(model, inputs, compile_specs=FP32), inputs)
    assert _error(ours, expected) < 1e-6
    assert _error(stock, expected) > 1e-4


def test_op_without_kernel_is_named(compiled, monkeypatch):
    artifact, _, _ = compiled["mlp", "fp32"]
    [program] = load_programs(artifact.pte)
    interpreter = MilInterpreter(program)
    monkeypatch.delitem(mil_kernels.KERNELS, "relu")
    with pytest.raises(UnsupportedMilOp) as caught:
        interpreter.run({interpreter.input_names[0]: np.zeros((4, 32), np.float32)})
    assert "'relu'" in caught.value.reason
    assert caught.value.nodes and caught.value.nodes[0] in caught.value.reason
    assert "mil_kernels.py" in caught.value.hint


class Mixed(torch.nn.Module):
    """Conv with stride, padding, dilation and groups; pools with ceil_mode and without padding
    counted; slicing, gather, concat, select, cumsum, softmax; attention with a bool mask."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2)

    def forward(self, x, q):
        y = self.conv(x)
        a = F.max_pool2d(y, 3, stride=2, ceil_mode=True).flatten(1)
        b = F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False).flatten(1)
        z = torch.cat([a, b[:, 1::3], torch.index_select(a, 1, torch.tensor([2, 0, 1]))], 1)
        z = torch.where(z > 0, z.softmax(-1), torch.cumsum(z, -1))
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        attention = F.scaled_dot_product_attention(q, q * 2, q + 1, attn_mask=mask)
        return z, attention.transpose(1, 2).reshape(2, 5, 8).mean(-1)


@pytest.mark.parametrize("target", [None, "iOS18"])  # iOS18: scaled_dot_product_attention is one op
def test_mixed_ops_match_eager(target):
    torch.manual_seed(0)
    model, inputs = Mixed().eval(), (torch.randn(2, 4, 13, 13), torch.randn(2, 2, 5, 4))
    with torch.no_grad():
        expected = [t.numpy() for t in model(*inputs)]
    options = {"compile_specs": FP32, **({"minimum_deployment_target": target} if target else {})}
    artifact = compile_coreml(model, inputs, **options)
    assert not artifact.program.plan.cpu_nodes
    ops = {t for m in models(artifact) for t in m.op_types()}
    assert ("scaled_dot_product_attention" in ops) == (target == "iOS18")
    [program] = load_programs(artifact.pte)
    interpreter = MilInterpreter(program)
    outputs = interpreter.run(dict(zip(interpreter.input_names, (t.numpy() for t in inputs))))
    for actual, wanted in zip(outputs.values(), expected):
        # float32 sums (cumsum over 129 values) in another order than torch: relative to the scale.
        assert _error(actual, wanted) < 1e-6 * max(1.0, float(np.abs(wanted).max()))
