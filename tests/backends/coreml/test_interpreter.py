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
from compiler.models.examples import EXAMPLES
from coreml_helpers import compile_coreml, models, stock_pte

# Kept out of the default run (its time budget): CI's slow job runs it (-m slow).
pytestmark = pytest.mark.slow

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
    for actual, wanted in zip(outputs.values(), expected, strict=True):
        # float32 sums (cumsum over 129 values) in another order than torch: relative to the scale.
        assert _error(actual, wanted) < 1e-6 * max(1.0, float(np.abs(wanted).max()))


def _run_all(pte, inputs):
    [program] = load_programs(pte)
    interpreter = MilInterpreter(program)
    return list(interpreter.run(dict(zip(interpreter.input_names, (t.numpy() for t in inputs)))).values())


class SliceAssign(torch.nn.Module):
    """A strided slice assignment: scatter (mode "update") before iOS 18, slice_update from it."""

    def forward(self, x):
        buf = x * 2
        buf[1:5:2, 1:] = x[:2, :2] + 1
        return buf * 3


@pytest.mark.parametrize("target, op", [(None, "scatter"), ("iOS18", "slice_update")])
def test_slice_assignment_matches_eager(target, op):
    torch.manual_seed(0)
    model, inputs = SliceAssign().eval(), (torch.randn(5, 3),)
    with torch.no_grad():
        expected = model(*inputs).numpy()
    options = {"compile_specs": FP32, **({"minimum_deployment_target": target} if target else {})}
    artifact = compile_coreml(model, inputs, **options)
    assert not artifact.program.plan.cpu_nodes
    assert op in {t for m in models(artifact) for t in m.op_types()}
    [actual] = _run_all(artifact.pte, inputs)
    assert actual.shape == expected.shape
    assert _error(actual, expected) < 1e-6


class TwoIndexGather(torch.nn.Module):
    def forward(self, x, i, j):
        return x[i, j] * 2


def test_two_index_tensors_gather_nd_matches_eager():
    torch.manual_seed(0)
    inputs = (torch.randn(4, 5, 3), torch.tensor([0, 3, 2, 3]), torch.tensor([4, 1, 1, 0]))
    model = TwoIndexGather().eval()
    expected = model(*inputs).numpy()
    artifact = compile_coreml(model, inputs, compile_specs=FP32)
    assert not artifact.program.plan.cpu_nodes
    assert "gather_nd" in {t for m in models(artifact) for t in m.op_types()}
    [actual] = _run_all(artifact.pte, inputs)
    assert actual.shape == expected.shape == (4, 3)
    assert _error(actual, expected) < 1e-6


def test_decoder_state_carries_between_calls():
    """iOS 18: the cache is Core ML state (read_state ... write_state), float16; two calls at two
    positions agree with eager running the same two steps with its cache rounded to float16 after
    each (within 1e-6), and the second differs from unrounded eager: the first call's write,
    rounded, is what the second reads."""
    import sys, pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
    from test_replay import DecoderStep

    torch.manual_seed(0)
    model = DecoderStep().eval()
    steps = [(torch.randn(1, 8), torch.tensor([1])), (torch.randn(1, 8), torch.tensor([3]))]
    artifact = compile_coreml(model, steps[0], minimum_deployment_target="iOS18", compile_specs=FP32)
    assert not artifact.program.plan.cpu_nodes
    ops = {t for m in models(artifact) for t in m.op_types()}
    assert {"read_state", "write_state"} <= ops and ops & {"scatter", "scatter_nd", "slice_update"}

    [program] = load_programs(artifact.pte)
    interpreter = MilInterpreter(program)
    [state] = interpreter.state_names
    with pytest.raises(Exception, match="has no value"):  # the state must be given
        interpreter.run(dict(zip(interpreter.input_names, (t.numpy() for t in steps[0]))))
    interpreter.state[state] = np.zeros((4, 8), np.float32)  # the buffer's initial value
    # Core ML state is float16 (the program casts the cache to fp32, updates it, and writes it
    # back as fp16): eager, after each step, keeps its cache rounded to float16 as the device.
    eager = DecoderStep().eval()
    eager.load_state_dict(model.state_dict())  # a fresh module: same weights, zero cache
    unrounded = DecoderStep().eval()
    unrounded.load_state_dict(model.state_dict())
    errors = []
    for inputs in steps:
        with torch.no_grad():
            expected, plain = eager(*inputs).numpy(), unrounded(*inputs).numpy()
            eager.cache.copy_(eager.cache.half().float())
        [actual] = interpreter.run(dict(zip(interpreter.input_names, (t.numpy() for t in inputs)))).values()
        errors.append((_error(actual, expected), _error(actual, plain)))
    assert all(error < 1e-6 for error, _ in errors), errors
    assert errors[1][1] > 1e-5  # the second call reads the first call's write, in float16
    assert interpreter.state[state].dtype == np.float16
    assert np.array_equal(interpreter.state[state], eager.cache.numpy().astype(np.float16))
    assert np.count_nonzero(interpreter.state[state].any(axis=1)) == 2  # rows 1 and 3 written


def test_scatter_and_gather_nd_kernels_follow_the_spec():
    """The modes and arguments no test model emits, against per-element loops of the spec's formulas."""
    rng = np.random.default_rng(0)
    data = rng.standard_normal((3, 4, 2)).astype(np.float32)
    indices = np.array([2, 0, 2])  # a repeated index: every update applies in turn
    updates = rng.standard_normal((3, 3, 2)).astype(np.float32) + 2
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
           "max": np.maximum, "min": np.minimum, "update": lambda old, new: new}
    for mode, op in ops.items():
        expected = data.copy()
        for i, index in enumerate(indices):
            expected[:, index] = op(expected[:, index], updates[:, i])
        actual = mil_kernels.KERNELS["scatter"](data, indices, updates, axis=1, mode=mode)
        np.testing.assert_allclose(actual, expected, rtol=1e-6, err_msg=mode)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    nd = np.array([[[0, 3], [2, 1], [1, 1]], [[2, 0], [0, 3], [1, 2]]])  # (2, 3, 2): batch_dims=1
    actual = mil_kernels.KERNELS["gather_nd"](x, nd, batch_dims=1)
    expected = np.stack([np.stack([x[b, i, j] for i, j in nd[b]]) for b in range(2)])
    assert actual.shape == (2, 3, 5) and np.array_equal(actual, expected)
