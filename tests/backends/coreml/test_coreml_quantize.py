"""Every Core ML quantization scheme compiles, its quantized ops run in Core ML, and the
payload computes what the eager quantized model computes.

Each case compiles a small Embedding + Linear model with a scheme of
`compiler/stages/schemes.py` (no deployment target given: the backend raises it to what
the scheme's ops need, as ExecuTorch's Core ML recipes do), asserts the quantized nodes are
placed in Core ML, runs the payload in the MIL interpreter and compares:

- with the eager quantized model (the quantize stage's module): within float16 compute
  noise, `EAGER_QUANTIZED_TOLERANCE` of the largest output (the payload stores scales and
  codebooks in float16 and computes in float16; eager computes in float32);
- with the float model: off by more than that (the scheme changed the weights).

A static scheme (PT2E: activations quantized too) may also differ by one step of its
output's quantizer: the value it rounds is float16 in the payload, float32 in eager. In
float32 the payload computes exactly what eager computes.

The kernel cases check the MIL compression kernels against coremltools' own op
definitions (value inference of `mil/ops/defs`), without a compile.
"""

from __future__ import annotations


import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, types

import compiler
from compiler.backends.coreml.mil_kernels import KERNELS
from compiler.running.runtime import compare_with_eager

# float16 keeps 11 significant bits (relative step 2**-11 ~ 5e-4): the weights, the
# scales and every stored activation round at that step, through two Linears of 64
# inputs; 1% of the largest output leaves room for that (weight-only schemes: 0.07% seen).
EAGER_QUANTIZED_TOLERANCE = 1e-2
# Against the float model a weight-only scheme's error is the quantization's: several
# times the float16 noise (8-bit weights: 10x seen).
QUANTIZATION_SHOWS = 3


class EmbedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(48, 64)
        self.up = torch.nn.Linear(64, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, tokens, x):
        return self.down(torch.relu(self.up(x + self.embed(tokens))))


def _model():
    torch.manual_seed(0)
    model = EmbedMLP().eval()
    draws = [(torch.randint(0, 48, (2, 3)), torch.randn(2, 3, 64)) for _ in range(4)]
    return model, draws


# The ops each flow leaves in the program for Core ML to take.
PT2E_OPS = {"quantized_decomposed"}
TORCHAO_OPS = {"torchao"}
CODEBOOK_OPS = {"quant"}

# (scheme, granularity, embedding scheme, namespaces of the quantized ops, the MIL op that
# carries the weights, the deployment target the backend raises to). The PT2E schemes take
# minutes each: ExecuTorch's CoreMLQuantizer exports its 405 patterns with torch.export
# (0.6 s each) in every prepare; `test_a_pt2e_program_runs_in_core_ml` covers their ops
# in the default run.
WEIGHT_ONLY_FAST = [
    ("4w", "per_group", "8w", TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18"),
    ("8w", "per_channel", None, TORCHAO_OPS, "constexpr_affine_dequantize", "iOS16"),
    ("codebook", "per_group", None, CODEBOOK_OPS, "constexpr_lut_to_dense", "iOS18"),
]
WEIGHT_ONLY_SLOW = [
    ("int8_weight", None, None, PT2E_OPS, "constexpr_affine_dequantize", "iOS17"),
    ("4w", "per_channel", None, TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18"),
    ("8w", "per_group", None, TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18"),
    (None, None, "4w", TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18"),
    (None, None, "8w", TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18"),
]


def _compile(scheme, granularity, embedding, **options):
    model, draws = _model()
    if granularity:
        options["quantize_granularity"] = granularity
    result = compiler.compile(
        model, draws[0], "coreml", quantize=scheme, quantize_embedding=embedding, calibration=draws, **options
    )
    return model, draws, result


def _namespace(op: str) -> str:
    return op.split(".", 1)[0]


def _mil_ops(result) -> set[str]:
    from compiler.backends.coreml.interpreter import load_programs

    return {op.op_type for program in load_programs(result.pte) for op in program.functions["main"].operations}


def _assert_placed_in_core_ml(result, namespaces, mil_op, target):
    plan = result.program.plan
    quantized = [p for p in plan.delegated_nodes if _namespace(p.op) in namespaces]
    assert quantized, f"no quantized op in Core ML: {[p.op for p in plan.delegated_nodes]}"
    assert not plan.cpu_nodes, {p.node: p.reason for p in plan.cpu_nodes}
    assert mil_op in _mil_ops(result)
    targets = {
        int(s.value) for spec in plan.partitions.values() for s in spec.compile_specs if s.key == "min_deployment_target"
    }
    assert targets == {ct.target[target].value}, targets


def _errors(result, eager_quantized, model, inputs):
    """The program's largest error against the eager quantized model and against the float
    model, and the largest eager quantized output (the program's bytes are compared, so each
    check compares with the module it is given)."""
    check = compare_with_eager(result.pte, eager_quantized, inputs)
    return check.max_abs_error, compare_with_eager(result.pte, model, inputs).max_abs_error, check.largest_expected


def _check_weight_only(scheme, granularity, embedding, namespaces, mil_op, target):
    model, draws, result = _compile(scheme, granularity, embedding)
    _assert_placed_in_core_ml(result, namespaces, mil_op, target)
    for inputs in draws[:2]:
        quantized, against_float, largest = _errors(result, result.stages["quantize"].module, model, inputs)
        assert quantized <= EAGER_QUANTIZED_TOLERANCE * largest, (quantized, largest)
        assert against_float > QUANTIZATION_SHOWS * quantized, (against_float, quantized)


@pytest.mark.parametrize("scheme, granularity, embedding, namespaces, mil_op, target", WEIGHT_ONLY_FAST)
def test_scheme_runs_in_core_ml_and_matches_the_eager_quantized_model(
    scheme, granularity, embedding, namespaces, mil_op, target
):
    _check_weight_only(scheme, granularity, embedding, namespaces, mil_op, target)


@pytest.mark.slow
@pytest.mark.parametrize("scheme, granularity, embedding, namespaces, mil_op, target", WEIGHT_ONLY_SLOW)
def test_every_other_weight_only_scheme_and_granularity(scheme, granularity, embedding, namespaces, mil_op, target):
    _check_weight_only(scheme, granularity, embedding, namespaces, mil_op, target)


def _output_step(module: torch.fx.GraphModule) -> float:
    """The step of the quantizer of a PT2E graph's output: float16 rounding before it may
    move an output value by one step (eager computes the value it rounds in float32)."""
    (output,) = [n for n in module.graph.nodes if n.op == "output"]
    dequantize = output.args[0][0]
    assert "dequantize_per_tensor" in str(dequantize.target)
    return float(dequantize.args[1])


def _check_static(model, draws, result, eager_quantized, precision_tolerance):
    step = _output_step(eager_quantized)
    for inputs in draws[:2]:
        quantized, against_float, largest = _errors(result, eager_quantized, model, inputs)
        assert quantized <= precision_tolerance * largest + step, (quantized, largest, step)
        assert against_float > quantized, (against_float, quantized)


def _pt2e_quantized(model, draws):
    """The model quantized by PT2E with XNNPACK's quantizer (seconds, not CoreMLQuantizer's
    minutes): int8 weights per channel and int8 activations, the ops int8_static leaves."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = torch.export.export(model, draws[0]).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(graph, quantizer)
    for inputs in draws:
        prepared(*inputs)
    return convert_pt2e(prepared)


@pytest.mark.parametrize("precision, tolerance", [("float16", EAGER_QUANTIZED_TOLERANCE), ("float32", 1e-5)])
def test_a_pt2e_program_runs_in_core_ml(precision, tolerance):
    """A model quantized beforehand: the backend raises the target to iOS17 for its ops. In
    float32 the payload computes what eager computes."""
    model, draws = _model()
    eager_quantized = _pt2e_quantized(model, draws)
    result = compiler.compile(eager_quantized, draws[0], "coreml", backend_options={"compute_precision": precision})
    _assert_placed_in_core_ml(result, PT2E_OPS, "quantize", "iOS17")
    _check_static(model, draws, result, eager_quantized, tolerance)


@pytest.mark.slow
def test_int8_static_with_the_core_ml_quantizer():
    model, draws, result = _compile("int8_static", None, None)
    _assert_placed_in_core_ml(result, PT2E_OPS, "quantize", "iOS17")
    _check_static(model, draws, result, result.stages["quantize"].module, EAGER_QUANTIZED_TOLERANCE)


def test_a_lower_target_than_the_scheme_needs_is_named():
    model, draws = _model()
    with pytest.raises(compiler.UserInputError) as err:
        compiler.compile(
            model, draws[0], "coreml", quantize="4w", backend_options={"minimum_deployment_target": "iOS17"}
        )
    text = f"{err.value} {err.value.hint}"
    assert "minimum_deployment_target" in text and "iOS18" in text and "iOS17" in text


def test_a_higher_target_than_the_scheme_needs_is_kept():
    """ExecuTorch's recipe replaces any target given with the scheme's minimum (8w per
    channel: iOS16, constexpr_affine_dequantize); ours keeps the one given."""
    model, draws = _model()
    result = compiler.compile(
        model, draws[0], "coreml", quantize="8w", backend_options={"minimum_deployment_target": "iOS18"}
    )
    _assert_placed_in_core_ml(result, TORCHAO_OPS, "constexpr_blockwise_shift_scale", "iOS18")


# --- the kernels against coremltools' definitions ---------------------------------------


def _spec(op_type, target, **inputs):
    with Function({}, opset_version=target):
        out = getattr(mb, op_type)(**inputs)
    value = out.val if out.val is not None else out.op.materialized_val_inference()
    assert value is not None
    return np.asarray(value)


def _agrees(op_type, target, **inputs):
    """Our kernel gives what coremltools' definition gives, bit for bit; returns it."""
    actual, expected = np.asarray(KERNELS[op_type](**inputs)), _spec(op_type, target, **inputs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)
    return actual


_RNG = np.random.default_rng(0)


@pytest.mark.parametrize("scale_shape", [(8, 1), (8, 4), (1, 16), (2, 2)])
@pytest.mark.parametrize("offset", [False, True])
def test_blockwise_shift_scale(scale_shape, offset):
    data = _RNG.integers(-8, 8, (8, 16)).astype(types.np_int4_dtype)
    scale = _RNG.uniform(0.01, 0.1, scale_shape).astype(np.float16)
    inputs = {"data": data, "scale": scale}
    if offset:
        inputs["offset"] = _RNG.integers(-8, 8, scale_shape).astype(types.np_int4_dtype)
    _agrees("constexpr_blockwise_shift_scale", ct.target.iOS18, **inputs)


@pytest.mark.parametrize("axis, scale_shape", [(0, (6,)), (1, (10,)), (-1, (10,)), (0, ())])
def test_affine_dequantize(axis, scale_shape):
    data = _RNG.integers(-128, 128, (6, 10)).astype(np.int8)
    scale = _RNG.uniform(0.01, 0.1, scale_shape).astype(np.float16)
    zero_point = _RNG.integers(-4, 4, scale_shape).astype(np.int8)
    inputs = {"quantized_data": data, "zero_point": zero_point, "scale": scale, "axis": np.int32(axis)}
    _agrees("constexpr_affine_dequantize", ct.target.iOS16, **inputs)


@pytest.mark.parametrize(
    "lut_shape, vector_axis", [((1, 2, 4, 1), None), ((3, 1, 4, 1), None), ((1, 1, 4, 2), 0), ((1, 1, 4, 3), 1)]
)
def test_lut_to_dense(lut_shape, vector_axis):
    indices = _RNG.integers(0, 4, (6, 8)).astype(types.np_uint2_dtype)
    lut = _RNG.standard_normal(lut_shape).astype(np.float16)
    inputs = {"indices": indices, "lut": lut}
    if vector_axis is not None:
        inputs["vector_axis"] = np.int32(vector_axis)
    _agrees("constexpr_lut_to_dense", ct.target.iOS18, **inputs)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("axis", [None, 1])
@pytest.mark.parametrize("precision", [np.float16, np.float32])
def test_quantize_and_dequantize(dtype, axis, precision):
    x = (_RNG.standard_normal((3, 5)) * 4).astype(precision)
    shape = () if axis is None else (5,)
    scale = _RNG.uniform(0.02, 0.05, shape).astype(precision)
    zero_point = _RNG.integers(0, 10, shape).astype(dtype)
    given = {"scale": scale, "zero_point": zero_point, **({} if axis is None else {"axis": np.int32(axis)})}
    quantized = _agrees("quantize", ct.target.iOS17, input=x, output_dtype=dtype, **given)
    _agrees("dequantize", ct.target.iOS17, input=quantized, **given)


def test_the_annotators_kept_are_those_whose_op_the_graph_holds():
    from compiler.ir.private_api import coreml_annotator_names, coreml_annotators_for

    every = coreml_annotator_names()
    linear = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    with coreml_annotators_for(linear.graph):
        kept = coreml_annotator_names()
    assert "linear" in kept and "linear_act" in kept and not [n for n in kept if n.startswith(("conv", "max_pool"))]
    assert coreml_annotator_names() == every


@pytest.mark.slow  # two Core ML PT2E compiles of each, every pattern graph made: minutes
@pytest.mark.parametrize("example", ["mlp", "convnet"])
def test_only_the_annotators_whose_op_the_model_holds_run_and_the_program_is_the_same(monkeypatch, example):
    # CoreMLQuantizer ran every annotator over every model: the convolution patterns took over half
    # of a 250M LLM's annotate, with no convolution in it.
    import contextlib

    from compiler.backends.coreml import quantizer
    from compiler.ir.private_api import coreml_annotator_names
    from compiler.models.examples import resolve_model

    model, inputs, _ = resolve_model(example)
    ran = []

    def spying_annotators():
        real = quantizer.coreml_annotators_for

        @contextlib.contextmanager
        def spy(graph):
            with real(graph):
                ran.extend(coreml_annotator_names())
                yield
        return spy

    monkeypatch.setattr(quantizer, "coreml_annotators_for", spying_annotators())
    filtered = compiler.compile(model, inputs, "coreml", quantize="int8_weight", cache=False)
    assert ("conv" in ran) == (example == "convnet") and "linear" in ran
    monkeypatch.setattr(quantizer, "coreml_annotators_for", lambda graph: contextlib.nullcontext())
    every = compiler.compile(model, inputs, "coreml", quantize="int8_weight", cache=False)
    assert filtered.pte == every.pte
