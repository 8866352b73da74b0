"""`locate` on a quantized program (issue 31, item 2): its stages are compared with the eager
quantized model with the check's allowance for activation quantizers rounding one step otherwise
(XNNPACK's own per-row dynamic scales), so a program that passes the check is not reported as
diverging, while a real fault in it still is."""

from __future__ import annotations

import pytest

import compiler
from compiler import backends
from compiler.models.examples import mlp
from compiler.running.runtime import compare_with_eager


@pytest.fixture(scope="module")
def model():
    return mlp(features=32, hidden=64, layers=2, batch=4)


def test_an_int8_dynamic_xnnpack_program_that_passes_the_check_is_not_reported_as_diverging(model):
    module, inputs = model
    result = compiler.compile(module, inputs, "xnnpack", quantize="int8_dynamic", reproducer=False)
    check = compare_with_eager(result, module, inputs)
    assert check.passed and check.max_abs_error > 1e-3, check.describe()  # off float32's own tolerance
    location = compiler.locate_result(result, module, inputs)
    assert location.stage is None, location.describe()
    lowered = next(row for row in location.stages if row.stage == "lower")
    assert lowered.max_error > 1e-3 and lowered.tolerance == pytest.approx(check.tolerance.absolute)
    assert "activation quantizers" in lowered.rule


class _AbsForRelu(backends.load("xnnpack")):
    """XNNPACK whose partition stage rewrites relu into abs: a real fault the allowance must not hide."""

    def partition(self, program):
        from executorch.exir.dialects._ops import ops as exir_ops

        result = super().partition(program)
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target == exir_ops.edge.aten.relu.default:
                node.target = exir_ops.edge.aten.abs.default
        program.graph_module.recompile()
        return result


def test_a_fault_in_a_quantized_program_is_still_located(model):
    module, inputs = model
    location = compiler.locate(module, inputs, _AbsForRelu(), quantize="int8_dynamic", reproducer=False)
    assert location.stage == "partition", location.describe()
    assert location.divergence is not None and location.divergence.op == "aten.abs.default", location.describe()
