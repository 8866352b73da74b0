"""A Core ML program computing in float16 is also checked lowered computing in float32: float16's
tolerance (1% of the largest output) hides a conversion fault below its noise, float32's does not."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiler
from compiler.backends.coreml.fixes import fixes_off
from compiler.running.tolerance import FLOAT32_ABSOLUTE
from tiny_models import RandomProgram


class LinearTanhGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def _model_and_inputs():
    torch.manual_seed(0)
    return LinearTanhGelu().eval(), (torch.randn(4, 16) * 3,)


def test_a_fault_below_float16_noise_fails_the_float32_conversion():
    model, inputs = _model_and_inputs()
    with fixes_off("tanh_gelu"):  # stock's conversion: the exact GELU
        result = compiler.compile(model, inputs, "coreml", verify=False)
        check = compiler.compare_with_eager(result, model, inputs)
    # At float16 the fault is inside the tolerance; at float32 it is not.
    assert check.max_abs_error <= check.tolerance.absolute
    assert check.at_float32 is not None and not check.at_float32.passed
    assert check.at_float32.tolerance.absolute == FLOAT32_ABSOLUTE
    assert check.at_float32.max_abs_error > FLOAT32_ABSOLUTE
    assert not check.passed and not check.to_json()["passed"]
    assert check.to_json()["at_float32"]["passed"] is False
    first, second = check.describe().splitlines()
    assert "-> OK" in first and "float16" in first
    assert second.startswith("the same partitions converted computing in float32") and "MISMATCH" in second


def test_the_fixed_conversion_passes_both():
    model, inputs = _model_and_inputs()
    result = compiler.compile(model, inputs, "coreml")
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed and check.at_float32.passed
    assert check.at_float32.max_abs_error < 1e-5 < check.max_abs_error
    # The float32 program is partitioned from the same program, into the same partitions.
    wide = result.at_float32()
    assert wide.report.stages[0].stage == "partition"
    assert wide.program.plan.tags() == result.program.plan.tags() and result.program.plan.tags()
    specs = [s for spec in wide.program.plan.partitions.values() for s in spec.compile_specs]
    assert {s.value for s in specs if s.key == "model_compute_precision"} == {b"float32"}


def test_no_float32_conversion_where_the_program_computes_in_float32():
    model, inputs = _model_and_inputs()
    wide = compiler.compile(model, inputs, "coreml", backend_options={"compute_precision": "float32"})
    assert wide.at_float32() is None
    assert compiler.compare_with_eager(wide, model, inputs).at_float32 is None
    portable = compiler.compile(model, inputs, "portable")
    assert portable.at_float32() is None
    assert compiler.compare_with_eager(portable, model, inputs).at_float32 is None


def test_the_float32_conversion_of_a_searched_program_uses_float32_specs():
    """A program the dry run searched carries that search's partitions, with float16's specs:
    the float32 conversion partitions again (found by the convex-partitions random program)."""
    torch.manual_seed(0)
    model, inputs = RandomProgram().eval(), (torch.randn(2, 2, 4), torch.randn(4, 4))
    result = compiler.compile(model, inputs, "coreml")
    assert result.stages["decompose"].searched is not None
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()
    specs = [s for spec in result.at_float32().program.plan.partitions.values() for s in spec.compile_specs]
    assert {s.value for s in specs if s.key == "model_compute_precision"} == {b"float32"}
